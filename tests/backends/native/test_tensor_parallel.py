"""Tensor parallelism on CPU (gloo, one worker process per extra rank): every split serves the same model.

Random-weight Llama models with the design's GQA shape (40 query / 8 KV heads, scaled down in width and
depth) split where the tensor-parallel size divides the KV heads, and a model with 2 KV heads split 4
ways (each KV head replicated on two ranks): greedy 64-token continuations of a batch of 16 prompts are
identical at TP 1, 2 and 4 and to transformers in fp32; SmolLM2 (9 query / 3 KV heads) at TP 3 equals
TP 1. Each rank holds 1/tp of the weights. A worker killed mid-burst fails every in-flight request and
the deployment's health; a size that cannot split the model is refused before any process starts.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from backends.base import SamplingParams
from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine
from gateway.app import create_app
from gateway.config import Settings
from gateway.deployments import Deployment
from gateway.limits import ConcurrencyLimiter
from gateway.routing import ModelGroup
from gateway.service import Gateway
from tests.backends.native.reference import hf_greedy
from tests.servers import serve_app

NEW_TOKENS = 24
DESIGN = Path(__file__).resolve().parents[3] / "configs" / "llama-12.3b-gqa.json"
# The design's head layout (40 query / 8 KV heads) at 1/8 of its width, 2 of its 40 layers, and SmolLM2's
# vocabulary (the prompts' token ids) in place of its own 100,096.
SCALED_DESIGN = {"hidden_size": 640, "intermediate_size": 13824 // 8, "num_hidden_layers": 2, "head_dim": 16,
                 "vocab_size": 49152, "max_position_embeddings": 512}
REPLICATED = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152, "max_position_embeddings": 512}


def _save_hf_model(path: Path, overrides: dict, tokenizer) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = {k: v for k, v in json.loads(DESIGN.read_text()).items() if k not in ("architectures", "torch_dtype")}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**config, **overrides})).eval()
    model.save_pretrained(path)
    tokenizer.hf.save_pretrained(path)
    return model


def _engine(path, tp: int, tokenizer, **overrides) -> LLMEngine:
    config = EngineConfig(model_path=str(path), tensor_parallel_size=tp, dtype="float32", max_model_len=512,
                          num_blocks=256, max_num_batched_tokens=256, num_threads=1, **overrides)
    return LLMEngine(config, tokenizer=tokenizer)


def _rank_bytes(cfg, tp: int) -> int:
    """fp32 weight bytes one of ``tp`` ranks holds: its shards, and what every rank holds whole (norms, a
    KV head shared by several ranks, the vocabulary padding)."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size // tp
    q, kv = cfg.num_heads // tp * d, max(cfg.num_kv_heads // tp, 1) * d
    vocab = -(-cfg.vocab_size // tp) * h * (1 if cfg.tie_word_embeddings else 2)
    layer = (q + 2 * kv) * h + h * q + 3 * inter * h + 2 * h
    return 4 * (vocab + cfg.num_layers * layer + h)


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    texts = ["Hello there", "The quick brown fox jumps over the lazy dog. " * 3, "1 2 3", "A", "def f(x):",
             "Once upon a time", "Paris is", "The history of computing is a story of abstraction. " * 4,
             "Q: What is the boiling point of water?\nA:", "import torch", "Dear hiring manager,", "<html>",
             "Roses are red,", "In summary,", "Step 1:", "The three laws of thermodynamics are"]
    return [smollm2_tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module", params=["design-40q-8kv", "replicated-8q-2kv"])
def model(request, tmp_path_factory, smollm2_tokenizer, prompts):
    """(HF directory, transformers' greedy continuations, the tensor-parallel sizes to check)."""
    overrides, sizes = (SCALED_DESIGN, (2, 4)) if request.param.startswith("design") else (REPLICATED, (4,))
    path = tmp_path_factory.mktemp(request.param)
    hf = _save_hf_model(path, overrides, smollm2_tokenizer)
    return path, [hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts], sizes


def test_every_split_equals_one_rank_and_transformers(model, prompts, smollm2_tokenizer):
    path, reference, sizes = model
    single = _engine(path, 1, smollm2_tokenizer)
    assert _greedy(single, prompts) == reference
    total = single.runner.weight_bytes()
    for tp in sizes:
        engine = _engine(path, tp, smollm2_tokenizer)
        try:
            assert _greedy(engine, prompts) == reference, f"tp={tp}"
            per_rank = engine.runner.call("weight_bytes")
            copies = engine.runner.call("small_step_copy_bytes")  # a second copy for small steps (linear.py)
            # Measured: what each process holds once (oneDNN's packed copies pad a little), against 1/tp of the
            # whole plus the parts every rank holds; and a rank holds no more than its share of the whole model.
            expected = _rank_bytes(engine.model_config, tp)
            held_once = [b - c for b, c in zip(per_rank, copies)]
            assert len(per_rank) == tp and all(abs(b - expected) <= 0.01 * expected for b in held_once), held_once
            assert max(per_rank) < 1.1 * total / tp
            assert not engine.has_unfinished() and engine.blocks.num_free_blocks == engine.blocks.num_blocks
        finally:
            engine.close()


def test_smollm2_split_three_ways_equals_one_rank(native_engine, prompts):
    engine = LLMEngine(EngineConfig(tensor_parallel_size=3, dtype="float32", max_model_len=1024, num_blocks=256,
                                    max_num_batched_tokens=512, num_threads=1), tokenizer=native_engine.tokenizer)
    try:
        assert engine.runner.call("weight_bytes")  # three ranks answer
        assert _greedy(engine, prompts[:6]) == _greedy(native_engine, prompts[:6])
    finally:
        engine.close()


@pytest.mark.parametrize("overrides, message", [
    ({"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 16, "hidden_size": 144}, "9 attention heads"),
    ({"num_key_value_heads": 3, "num_attention_heads": 6, "head_dim": 16, "hidden_size": 96},
     "3 key/value heads"),
])
def test_a_size_that_cannot_split_the_model_is_refused_before_any_worker_starts(tmp_path, smollm2_tokenizer,
                                                                               overrides, message):
    path = tmp_path / "model"
    _save_hf_model(path, {**REPLICATED, **overrides}, smollm2_tokenizer)
    with pytest.raises(ValueError, match=message):
        _engine(path, 4 if "attention" in message else 2, smollm2_tokenizer)
    assert not multiprocessing.active_children()


def test_a_worker_killed_mid_burst_fails_its_requests_and_the_deployment(tmp_path, smollm2_tokenizer):
    path = tmp_path / "model"
    _save_hf_model(path, REPLICATED, smollm2_tokenizer)
    engine = _engine(path, 2, smollm2_tokenizer)
    backend = NativeBackend("tp", engine=engine)
    group = ModelGroup("tp", [Deployment(name="tp-0", backend=backend, limiter=ConcurrencyLimiter(64, 64))])
    gateway = Gateway(Settings(router={"health_interval_s": 0.2}), [group])
    try:
        with serve_app(create_app(gateway)) as url:
            results: list[str] = []

            def one_request(i: int) -> None:
                body = {"model": "tp", "prompt": f"Count to a thousand, take {i}:", "max_tokens": 400,
                        "ignore_eos": True, "stream": True}
                try:
                    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                        text = "".join(r.iter_lines())
                    results.append("error" if r.status_code != 200 or '"error"' in text else "ok")
                except httpx.HTTPError:
                    results.append("error")

            clients = [threading.Thread(target=one_request, args=(i,)) for i in range(8)]
            for c in clients:
                c.start()
            deadline = time.monotonic() + 60
            while engine.generation_tokens_total < 20:  # the burst is under way
                assert time.monotonic() < deadline
                time.sleep(0.05)
            engine.runner.workers[0].kill()
            for c in clients:
                c.join(timeout=60)
            assert not any(c.is_alive() for c in clients), "a request hangs"
            assert results == ["error"] * 8
            deadline = time.monotonic() + 10
            while True:
                (deployment,) = httpx.get(f"{url}/admin/backends").json()["models"][0]["deployments"]
                if not deployment["healthy"]:
                    break
                assert time.monotonic() < deadline, "the deployment still reports healthy"
                time.sleep(0.1)
    finally:
        engine.close()
    assert not multiprocessing.active_children()
