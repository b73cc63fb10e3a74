"""Configuration: YAML validated by pydantic, environment overrides, the embedded default, CLI options."""

from __future__ import annotations

import pytest
import typer
from pydantic import ValidationError
from typer.testing import CliRunner

from gateway.cli import BackendKind, app, build_settings
from gateway.config import DEFAULT_MODEL_NAME, Settings, hash_key, load_settings
from gateway.deployments import build_backend

YAML = """
models:
  - name: smol
    deployments:
      - kind: native
        dtype: bfloat16
        max_concurrency: 8
        kernels: torch
      - kind: openai
        url: http://127.0.0.1:9/v1
        upstream_model: smol-upstream
api_keys:
  - name: team-a
    key: sk-a
    requests_per_minute: 10
limits:
  max_body_bytes: 100000
"""


def test_yaml_is_loaded_and_keys_hashed(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text(YAML)
    s = load_settings(path)
    assert [r.name for r in s.routes()] == ["smol"]
    native, remote = s.models[0].deployments
    assert native.dtype == "bfloat16" and native.max_concurrency == 8 and remote.upstream_model == "smol-upstream"
    assert build_backend("smol", native).config.kernels == "torch"  # reaches the engine
    assert s.api_keys[0].key is None and s.api_keys[0].sha256 == hash_key("sk-a")
    assert s.limits.max_body_bytes == 100000


def test_environment_overrides_the_file(tmp_path, monkeypatch):
    path = tmp_path / "gw.yaml"
    path.write_text(YAML)
    monkeypatch.setenv("BURSTGATE_LIMITS__MAX_BODY_BYTES", "5000")
    monkeypatch.setenv("BURSTGATE_API_KEY", "sk-env")
    s = load_settings(path)
    assert s.limits.max_body_bytes == 5000
    assert hash_key("sk-env") in {k.sha256 for k in s.api_keys}


def test_no_config_means_the_embedded_default():
    (route,) = load_settings(None).routes()
    assert route.name == DEFAULT_MODEL_NAME and route.deployments[0].kind == "native"
    assert route.deployments[0].model_path is None


@pytest.mark.parametrize("bad", [
    "models: [{name: x, deployments: []}]",
    "models: [{name: x, deployments: [{kind: openai}]}]",  # remote without url
    "models: [{name: x, deployments: [{kind: quantum}]}]",
    "models: [{name: x, deployments: [{max_concurrency: 0}]}]",
    "models: [{name: x, deployments: [{kernels: flash}]}]",
    "api_keys: [{name: nokey}]",
    "unknown_section: 1",
    "- just\n- a list",
])
def test_invalid_config_is_refused(tmp_path, bad):
    path = tmp_path / "bad.yaml"
    path.write_text(bad)
    with pytest.raises((ValidationError, ValueError)):
        load_settings(path)


def test_native_deployments_hand_every_engine_setting_to_the_engine_whole():
    from backends.native.config import EngineConfig
    from gateway.config import NativeDeployment

    values = {"dtype": "bfloat16", "device": "cpu", "kv_cache_gb": 0.5, "max_num_seqs": 7, "enforce_eager": True,
              "gpu_memory_utilization": 0.5, "load_format": "dummy", "hf_overrides": {"num_hidden_layers": 2},
              "kernels": "torch", "max_model_len": 128, "num_threads": 1, "enable_chunked_prefill": False}
    deployment = Settings(models=[{"name": "m", "deployments": [values]}]).models[0].deployments[0]
    engine = build_backend("m", deployment).config
    assert type(engine) is EngineConfig and engine.model_dump(include=set(values)) == values
    # every engine setting is a deployment setting: a new one is one field in EngineConfig
    assert set(EngineConfig.model_fields) <= set(NativeDeployment.model_fields)


def test_api_keys_come_from_the_environment_by_name(monkeypatch):
    monkeypatch.setenv("UPSTREAM_KEY", "sk-secret")
    models = [{"name": "a", "deployments": [{"kind": "openai", "url": "http://x/v1", "api_key_env": "UPSTREAM_KEY"},
                                            {"kind": "tgi", "url": "http://y", "api_key": "os.environ/UPSTREAM_KEY"}]}]
    assert [d.api_key for d in Settings(models=models).models[0].deployments] == ["sk-secret", "sk-secret"]
    monkeypatch.delenv("UPSTREAM_KEY")
    with pytest.raises(ValueError, match="UPSTREAM_KEY named for the api key is not set"):
        Settings(models=models)


def test_serve_options_reach_the_default_deployment():
    (route,) = build_settings(None, None, dtype="bfloat16", device="cpu").routes()
    assert (route.deployments[0].dtype, route.deployments[0].device) == ("bfloat16", "cpu")
    with pytest.raises(typer.BadParameter, match="device"):
        build_settings(None, None, device="gpu7")
    with pytest.raises(typer.BadParameter, match="--device apply to the native engine only"):
        build_settings(None, None, None, BackendKind.deepspeed, device="cpu")
    with pytest.raises(typer.BadParameter, match="--tensor-parallel-size"):
        build_settings(None, None, None, BackendKind.deepspeed, tensor_parallel_size=2)
    (route,) = build_settings(None, None, tensor_parallel_size=3).routes()
    assert route.deployments[0].tensor_parallel_size == 3
    (route,) = build_settings(None, None, kv_cache_dtype="fp8_e5m2").routes()
    assert route.deployments[0].kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(typer.BadParameter, match="--kv-cache-dtype apply to the native engine only"):
        build_settings(None, None, None, BackendKind.deepspeed, kv_cache_dtype="fp8")
    with pytest.raises(typer.BadParameter, match="kv_cache_dtype"):  # the engine's config names what it takes
        build_settings(None, None, kv_cache_dtype="int4")
    (route,) = build_settings(None, None, block_size=32).routes()
    assert route.deployments[0].block_size == 32
    with pytest.raises(typer.BadParameter, match="--block-size apply to the native engine only"):
        build_settings(None, None, None, BackendKind.deepspeed, block_size=16)
    refused = CliRunner().invoke(app, ["serve", "--block-size", "128"])  # past what the CPU kernels hold
    assert refused.exit_code == 2 and "--block-size" in refused.output and "less than or equal to 64" in refused.output


def test_engine_options_are_refused_where_no_native_deployment_would_use_them(tmp_path):
    path = tmp_path / "remote.yaml"
    path.write_text("models: [{name: r, deployments: [{kind: openai, url: 'http://x/v1'}]}]")
    with pytest.raises(typer.BadParameter, match="no native deployment"):
        build_settings(path, None, dtype="float16")


def test_model_option_serves_a_local_path(tmp_path, smollm2_path):
    s = build_settings(None, smollm2_path, "mine")
    (route,) = s.routes()
    assert route.name == "mine" and route.deployments[0].model_path == str(smollm2_path)
    with pytest.raises(Exception, match="does not exist"):
        build_settings(None, tmp_path / "missing.gguf")


def test_served_model_name_alone_renames_the_one_configured_model(tmp_path):
    (route,) = build_settings(None, None, "smol").routes()
    assert route.name == "smol" and route.deployments[0].kind == "native"
    path = tmp_path / "two.yaml"
    path.write_text("models: [{name: a, deployments: [{kind: openai, url: 'http://x/v1'}]},"
                    " {name: b, deployments: [{kind: openai, url: 'http://y/v1'}]}]")
    with pytest.raises(typer.BadParameter, match="serves 2 models"):
        build_settings(path, None, "c")


def test_backend_option_serves_the_model_on_deepspeed_inference():
    (route,) = build_settings(None, None, None, BackendKind.deepspeed, dtype="bfloat16").routes()
    assert route.name == DEFAULT_MODEL_NAME and route.deployments[0].kind == "deepspeed"
    assert route.deployments[0].dtype == "bfloat16" and route.deployments[0].model_path is None


def test_cli_help_lists_serve_options():
    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--host", "--port", "--config", "--model", "--dtype", "--workers"):
        assert option in result.output


def test_shipped_example_config_is_valid(monkeypatch):
    from pathlib import Path

    monkeypatch.setenv("VLLM_API_KEY", "sk-vllm")  # its vLLM deployment reads the key from the environment
    s = load_settings(Path(__file__).resolve().parents[2] / "deploy" / "config" / "gateway.example.yaml")
    assert [[d.kind for d in m.deployments] for m in s.models] == [["native", "openai"], ["tgi"], ["deepspeed", "mii"]]
    assert s.models[0].routing.policy == "prefix_affinity" and s.models[0].fallbacks == ["smollm2-tgi"]
    assert s.api_keys == [] and s.limits.redis_url  # keys come from BURSTGATE_API_KEYS (tests/deploy)


@pytest.mark.parametrize("models, message", [
    ([{"name": "a", "deployments": [{"kind": "native"}], "fallbacks": ["b"]}], "fallbacks must name other"),
    ([{"name": "a", "deployments": [{"kind": "native"}], "fallbacks": ["a"]}], "fallbacks must name other"),
    ([{"name": "a", "deployments": [{"kind": "native"}], "routing": "random"}], "routing"),
    ([{"name": "a", "deployments": [{"kind": "mii", "url": "http://x"}]}], r"mii\.upstream_model\n +Field required"),
    ([{"name": "a", "deployments": [{"kind": "tgi", "url": "http://x", "chat": "template"}]}], "needs a tokenizer"),
    ([{"name": "a", "deployments": [{"kind": "lightllm"}]}], r"lightllm\.url\n +Field required"),
    # a field of another kind is refused, naming the kind it was given to
    ([{"name": "a", "deployments": [{"kind": "tgi", "url": "http://x", "kv_cache_gb": 4}]}],
     r"tgi\.kv_cache_gb\n +Extra inputs are not permitted"),
    ([{"name": "a", "deployments": [{"url": "http://x"}]}], r"native\.url\n +Extra inputs are not permitted"),
    ([{"name": "a", "deployments": [{"kind": "deepspeed", "max_num_seqs": 4}]}], r"deepspeed\.max_num_seqs"),
    ([{"name": "a", "deployments": [{"kind": "native", "device": "tpu"}]}], r"native\.device"),
    ([{"name": "a", "deployments": [{"kind": "native", "gpu_memory_utilization": 1.5}]}], "gpu_memory_utilization"),
])
def test_routing_and_deployment_mistakes_are_refused_at_load(models, message):
    with pytest.raises(ValueError, match=message):
        Settings(models=models)


def test_resilience_settings_are_read_under_their_earlier_name_router_too():
    assert Settings(router={"retries": 7}).resilience.retries == 7
    assert Settings(resilience={"retries": 4}).resilience.retries == 4
    assert Settings().resilience.retries == 2


def test_a_drain_grace_window_longer_than_its_deadline_is_refused():
    with pytest.raises(ValueError, match="drain_grace_s must be shorter than drain_timeout_s"):
        Settings(server={"drain_grace_s": 30, "drain_timeout_s": 10})


def test_two_native_engines_split_over_ranks_in_one_process_are_refused(tmp_path):
    path = tmp_path / "split.yaml"
    path.write_text("models: [{name: a, deployments: [{tensor_parallel_size: 2}]},"
                    " {name: b, deployments: [{pipeline_parallel_size: 2}]}]")
    with pytest.raises(ValueError, match="at most one native engine split over ranks"):
        load_settings(path)
    path.write_text("models: [{name: a, deployments: [{tensor_parallel_size: 2}]}, {name: b, deployments: [{}]}]")
    assert len(load_settings(path).models) == 2  # one split engine beside a whole one is fine
