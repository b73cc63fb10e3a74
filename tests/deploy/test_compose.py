"""deploy/compose.yaml starts as written: valid Compose, internal services unpublished, vLLM and TGI
able to share one GPU whichever way it is counted, limits on every service, keys from the environment."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from gateway.config import hash_key, load_settings
from tests.deploy.files import DEPLOY, documents

COMPOSE = DEPLOY / "compose.yaml"
EXAMPLE_CONFIG = DEPLOY / "config" / "gateway.example.yaml"


def services(env: dict[str, str] | None = None) -> dict[str, dict]:
    """The services, with ``${NAME:-default}`` in string values interpolated from ``env`` (as compose does,
    after parsing: an interpolated value stays a string)."""
    def interpolate(value):
        if isinstance(value, str):
            return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: (env or {}).get(m.group(1)) or m.group(2) or "",
                          value)
        if isinstance(value, dict):
            return {k: interpolate(v) for k, v in value.items()}
        if isinstance(value, list):
            return [interpolate(v) for v in value]
        return value

    return interpolate(documents(COMPOSE)[0]["services"])


def test_compose_is_valid_against_the_compose_specification():
    out = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                          str(COMPOSE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_references_existing_files():
    gateway = services()["gateway-a"]
    assert (DEPLOY / gateway["build"]["context"] / gateway["build"]["dockerfile"]).is_file()
    for service in services().values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), source


def test_only_the_gateways_and_dashboards_are_published_and_only_on_loopback_by_default():
    published = {name: s["ports"] for name, s in services().items() if s.get("ports")}
    assert set(published) == {"gateway-a", "gateway-b", "prometheus", "grafana"}  # not redis, vllm, tgi
    for name, ports in published.items():
        for port in ports:
            assert port.startswith("127.0.0.1:"), f"{name}: {port}"
    opened = services({"BURSTGATE_BIND": "0.0.0.0"})
    assert opened["gateway-a"]["ports"] == ["0.0.0.0:8000:8000"] and opened["grafana"]["ports"][0].startswith("127.")


def vllm_then_tgi(utilization: float, fraction: float) -> tuple[float, float]:
    """Shares of one GPU (of its total) when vLLM starts first, then TGI; 0 for one that cannot start.
    vLLM takes utilization x total and refuses to start with less free (vllm/v1/worker/gpu_worker.py);
    TGI takes free - (1 - fraction) x total (text_generation_server/utils/import_utils.py)."""
    vllm = utilization if utilization <= 1.0 else 0.0
    return vllm, max(0.0, (1.0 - vllm) - (1.0 - fraction))


def gpu_settings(env: dict[str, str] | None = None) -> tuple[float, float, str, str]:
    s = services(env)
    utilization = float(s["vllm"]["command"][s["vllm"]["command"].index("--gpu-memory-utilization") + 1])
    fraction = float(s["tgi"]["command"][s["tgi"]["command"].index("--cuda-memory-fraction") + 1])
    devices = [s[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n in ("vllm", "tgi")]
    return utilization, fraction, *(d[0] for d in devices)


def test_vllm_and_tgi_share_one_gpu_whichever_restarts():
    s = services()
    assert s["tgi"]["depends_on"] == {"vllm": {"condition": "service_healthy"}}  # the order the shares assume
    assert "healthcheck" in s["vllm"]
    utilization, fraction, vllm_gpu, tgi_gpu = gpu_settings()
    assert vllm_gpu == tgi_gpu == "0"
    vllm, tgi = vllm_then_tgi(utilization, fraction)
    assert vllm >= 0.4 and tgi >= 0.4, (vllm, tgi)
    assert 1.0 - tgi >= utilization  # vLLM restarting beside a running TGI finds its share free
    # The defaults of vLLM (0.9) and TGI (1.0) would leave TGI a tenth, and vLLM nothing if TGI came first.
    assert vllm_then_tgi(0.9, 1.0)[1] == pytest.approx(0.1)


def test_two_gpus_are_pinned_one_each():
    _, _, vllm_gpu, tgi_gpu = gpu_settings({"VLLM_GPU": "0", "TGI_GPU": "1"})
    assert (vllm_gpu, tgi_gpu) == ("0", "1")


def test_every_service_has_cpu_and_memory_limits_and_the_gateways_match_their_threads_to_them():
    for name, s in services().items():
        assert "cpus" in s and "mem_limit" in s, name
    for name in ("gateway-a", "gateway-b"):
        gateway = services()[name]
        assert int(gateway["environment"]["OMP_NUM_THREADS"]) == gateway["cpus"]
        assert gateway["read_only"] is True and gateway["tmpfs"] == ["/tmp"] and gateway["cap_drop"] == ["ALL"]


def test_client_keys_come_from_the_environment_and_the_example_ships_none(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "")  # as compose sets it when deploy/.env has none
    text = EXAMPLE_CONFIG.read_text()
    assert hash_key("password") not in text and "sha256:" not in text
    assert load_settings(EXAMPLE_CONFIG).api_keys == []
    gateway_env = services()["gateway-a"]["environment"]
    monkeypatch.setenv("BURSTGATE_API_KEYS", gateway_env["BURSTGATE_API_KEYS"])  # unset in deploy/.env: none
    assert load_settings(EXAMPLE_CONFIG).api_keys == []
    gateway_env = services({"BURSTGATE_API_KEYS": '[{"name": "team-a", "key": "k-123"}]'})["gateway-a"]["environment"]
    monkeypatch.setenv("BURSTGATE_API_KEYS", gateway_env["BURSTGATE_API_KEYS"])
    assert [(k.name, k.sha256) for k in load_settings(EXAMPLE_CONFIG).api_keys] == [("team-a", hash_key("k-123"))]


def test_vllms_key_reaches_vllm_and_the_gateways_from_the_environment_alone(monkeypatch):
    for env, key in (({}, ""), ({"VLLM_API_KEY": "sk-vllm"}, "sk-vllm")):  # empty: neither side uses a key
        compose = services(env)
        assert compose["vllm"]["environment"]["VLLM_API_KEY"] == key
        monkeypatch.setenv("VLLM_API_KEY", compose["gateway-a"]["environment"]["VLLM_API_KEY"])
        (vllm,) = [d for m in load_settings(EXAMPLE_CONFIG).models for d in m.deployments if d.name == "vllm"]
        assert vllm.api_key == key
