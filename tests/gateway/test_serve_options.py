"""``burstgate serve`` as a user starts it: every engine option reaches the running engine, checked by what
the engine itself reports on GET /info (the resolved dtype and device, not the configured words)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import torch

from backends.native.config import cpu_has_native_bf16
from tests.servers import free_port


@contextlib.contextmanager
def serve(*options: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--log-level",
                             "warning", *options], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # a loaded 2-core machine loads and warms up the model slowly
        while True:
            assert proc.poll() is None, proc.stderr.read()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "burstgate serve did not become ready"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _engine(url: str) -> dict:
    (model,) = httpx.get(f"{url}/info").json()["models"]
    return model["name"], model["deployments"][0]["engine"]


def test_dtype_device_and_name_options_reach_the_running_engine():
    with serve("--dtype", "bfloat16", "--device", "cpu", "--served-model-name", "smol-bf16") as url:
        name, engine = _engine(url)
        assert name == "smol-bf16" and engine["dtype"] == "bfloat16" and engine["device"] == "cpu"
        reply = httpx.post(f"{url}/v1/completions", json={"model": "smol-bf16", "prompt": "Hi", "max_tokens": 2},
                           timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_by_default_the_engine_runs_what_auto_resolves_to_here():
    with serve() as url:
        _, engine = _engine(url)
        on_gpu = torch.cuda.is_available()
        expected = "bfloat16" if on_gpu or cpu_has_native_bf16() else "float32"
        assert engine["dtype"] == expected and engine["device"].startswith("cuda" if on_gpu else "cpu")
        assert engine["kernels"] and engine["num_blocks"] > 0
