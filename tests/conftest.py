"""Fixtures shared by every test package: the embedded model, transformers as the reference, and a
real gateway in front of one shared native engine (loaded once per session)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine, start_engine
from backends.native.weights import default_model_path
from gateway.app import create_app
from gateway.config import Settings
from gateway.deployments import Deployment
from gateway.limits import ConcurrencyLimiter
from gateway.routing import ModelGroup
from gateway.service import Gateway
from tests.servers import serve_app

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a model hub
torch.set_num_threads(2)

MODEL = "smollm2"  # the public name tests serve the shared engine under


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' own loading of the same GGUF, in fp32: the reference for correctness."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from backends.tokenizer import Tokenizer

    return Tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def native_engine(smollm2_tokenizer) -> LLMEngine:
    return start_engine(EngineConfig(dtype="float32", max_model_len=1024, num_blocks=256,
                                  max_num_batched_tokens=512),
                     tokenizer=smollm2_tokenizer)


@pytest.fixture(scope="session")
def start_gateway(native_engine):
    """Factory: ``with start_gateway(**settings) as url`` serves MODEL from the shared engine."""

    @contextlib.contextmanager
    def start(max_concurrency: int = 64, max_queue: int = 256, rate_limiter=None, backend_config=None, **settings):
        """``backend_config``: the deployment's settings the backend reads (tool parser, chat template)."""
        backend = NativeBackend(MODEL, config=backend_config, engine=native_engine)
        group = ModelGroup(MODEL, [Deployment(name="native-0", backend=backend,
                                                   limiter=ConcurrencyLimiter(max_concurrency, max_queue))])
        gateway = Gateway(Settings(**settings), [group], rate_limiter=rate_limiter)
        with serve_app(create_app(gateway)) as url:
            yield url, gateway

    return start


@pytest.fixture(autouse=True)
def _no_log_handler_left_on_a_closed_stream():
    """``burstgate serve`` run in-process (CliRunner) points the root logger at the runner's stderr, closed once the
    command returns: a server thread of a later test would log its access lines into that closed file."""
    yield
    root = logging.getLogger()
    for handler in root.handlers[:]:
        if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
            root.removeHandler(handler)


@pytest.fixture
def engine_idle(native_engine):
    """Asserts after the test that the engine holds no sequence and no KV block."""
    yield native_engine
    bm = native_engine.blocks
    for _ in range(200):
        if bm.num_free_blocks == bm.num_blocks and not native_engine.has_unfinished():
            break
        time.sleep(0.05)
    assert not native_engine.has_unfinished(), "a sequence is still in the engine"
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
