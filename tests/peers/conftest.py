"""One real vLLM for the peer suite: the exported SmolLM2 in fp32, with vLLM's hermes tool parser and the
same ChatML tools template burstgate's native deployments use (configs/chat_templates/chatml_tools.jinja), and
its scale-out routes on (the render routes; burstgate serves them always) and its KV-cache events published."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.native.config import EngineConfig
from benchmarks.peers import export_hf_dir, free_port, start_vllm
from gateway.app import create_app
from gateway.config import ModelRoute, Settings
from gateway.service import Gateway
from tests.servers import serve_app

TOOLS_TEMPLATE = Path(__file__).resolve().parents[2] / "configs" / "chat_templates" / "chatml_tools.jinja"


@pytest.fixture(scope="session")
def vllm_kv_events() -> str:
    """Where the peer vLLM publishes its KV-cache events (ZMQ, topic "kv")."""
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="session")
def vllm_url(vllm_kv_events):
    port = free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
              "endpoint": vllm_kv_events.replace("127.0.0.1", "*")}
    proc = start_vllm(port, extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                        "--chat-template", str(TOOLS_TEMPLATE), "--enable-scale-out",
                                        "--kv-events-config", json.dumps(events)))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="session")
def burstgate_url():
    """burstgate serving what the peer vLLM serves, as "smollm2": the same weights, template and tool parser."""
    engine = {"model_path": str(export_hf_dir()), "dtype": "float32", "max_model_len": 2048,
              "tool_parser": "hermes", "chat_template": str(TOOLS_TEMPLATE)}
    EngineConfig(**engine)  # fail early on a bad setting
    settings = Settings(models=[ModelRoute(name="smollm2", deployments=[{"kind": "native", **engine}])])
    with serve_app(create_app(Gateway.from_settings(settings))) as url:
        yield url
