"""``GET /info``: the server's devices and each deployment's kind and settings, behind the API keys."""

from __future__ import annotations

import httpx
import psutil

from gateway.app import create_app
from gateway.config import Settings
from gateway.info import describe, public_settings
from gateway.service import Gateway
from loadtest.mock_server import create_mock_app
from tests.conftest import MODEL
from tests.servers import serve_app


def test_info_reports_the_devices_and_the_native_engine_settings_behind_the_keys(start_gateway):
    with start_gateway(api_keys=[{"name": "ops", "key": "sk-ops"}]) as (url, _):
        assert httpx.get(f"{url}/info").status_code == 401
        info = httpx.get(f"{url}/info", headers={"Authorization": "Bearer sk-ops"}).json()
    cpu = info["devices"][0]
    assert cpu["kind"] == "cpu" and cpu["count"] == psutil.cpu_count() and cpu["memory_bytes"] > 0 and cpu["name"]
    assert info["hardware"] == describe(info["devices"])
    gpus = [d for d in info["devices"] if d["kind"] == "cuda"]  # memory in use, one figure per GPU
    assert len(info["gpu_memory_used_bytes"]) == sum(d["count"] for d in gpus)
    (model,) = info["models"]
    (deployment,) = model["deployments"]
    assert model["name"] == MODEL and deployment["kind"] == "native"
    engine = deployment["engine"]  # the shared test engine's own settings, not defaults
    assert engine["num_blocks"] == 256 and engine["max_model_len"] == 1024 and engine["device"] == "cpu"
    assert {"dtype", "kernels", "max_num_seqs", "kv_cache_bytes", "enable_prefix_caching"} <= engine.keys()


def test_info_shows_configured_deployments_without_their_secrets():
    with serve_app(create_mock_app("up")) as upstream:
        settings = Settings(models=[{"name": "remote", "deployments": [
            {"kind": "openai", "url": f"{upstream}/v1", "api_key": "sk-upstream-secret", "max_concurrency": 7}]}])
        with serve_app(create_app(Gateway.from_settings(settings))) as url:
            r = httpx.get(f"{url}/info")
    assert r.status_code == 200 and "sk-upstream-secret" not in r.text
    (deployment,) = r.json()["models"][0]["deployments"]
    assert deployment["kind"] == "openai" and deployment["settings"]["max_concurrency"] == 7
    assert "api_key" not in deployment["settings"] and "engine" not in deployment


def test_describe_names_gpus_with_their_count_else_the_cpu():
    cpu = {"kind": "cpu", "name": "Xeon", "count": 16, "memory_bytes": 1}
    assert describe([cpu]) == "cpu: 16x Xeon"
    h100 = {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "count": 8, "memory_bytes": 80 << 30}
    assert describe([cpu, h100]) == "8x NVIDIA H100 80GB HBM3"


def test_public_settings_drops_secrets_at_any_depth():
    data = {"url": "u", "api_key": "k", "nested": [{"upstream_api_key": "k2", "headers": {"Authorization": "b"}}],
            "max_num_batched_tokens": 5, "tokenizer": "t"}
    assert public_settings(data) == {"url": "u", "nested": [{"headers": {}}], "max_num_batched_tokens": 5,
                                     "tokenizer": "t"}
