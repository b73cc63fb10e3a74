"""A gateway in front of remote backends alone never loads torch, nor the native engine: its image and its start
stay small (the engine's code is imported per deployment kind, in gateway/deployments.py). With tracing off, the
OpenTelemetry SDK is not loaded either (gateway/tracing.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest.mock_server import create_mock_app
from tests.servers import serve_app

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from fastapi.testclient import TestClient
from gateway.app import create_app
from gateway.config import Settings
from gateway.service import Gateway

upstream = sys.argv[1]
settings = Settings(models=[{"name": "m", "deployments": [
    {"kind": "openai", "url": upstream + "/v1", "upstream_model": "upstream"}]}])
with TestClient(create_app(Gateway.from_settings(settings))) as client:
    answers = [
        client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 3}).status_code,
        client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 3, "stream": True,
                                                  "messages": [{"role": "user", "content": "Hi"}]}).status_code,
        client.get("/v1/models").status_code, client.get("/info").status_code,
        client.get("/metrics").status_code, client.get("/ready").status_code]
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers", "triton", "xgrammar"})
print(json.dumps({"answers": answers, "loaded": loaded, "engine": "backends.native.engine" in sys.modules,
                  "tracing": "opentelemetry.sdk" in sys.modules}))
"""


def test_a_gateway_of_remote_backends_never_loads_torch_or_the_engine():
    with serve_app(create_mock_app("upstream")) as upstream:  # in this process: the gateway's is the one measured
        out = subprocess.run([sys.executable, "-c", SCRIPT, upstream], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["answers"] == [200] * 6  # it served every kind of route
    assert result == {"answers": [200] * 6, "loaded": [], "engine": False, "tracing": False}
