"""A simulated replica speaks what a real one speaks: `burstgate serve --simulate PROFILE` is a native deployment
whose engine runs its own scheduler and block manager with no model, each step taking the profile's time. Two of
them behind the gateway's cache-aware routing, through the openai SDK: completions and chat streamed token by
token, /tokenize, /health, /metrics under vLLM's names, and the KV events routing follows."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.cli import build_settings
from gateway.config import Settings
from gateway.service import Gateway
from tests.servers import free_ports, serve_app

DESIGN = "configs/llama-12.3b-gqa.json"


@pytest.fixture(scope="module")
def fleet():
    *ports, http = free_ports(3)  # together: the engines bind their events' ports at the app's start-up
    deployments = [{"kind": "native", "name": f"replica-{i}", "model_path": DESIGN, "simulate": {"profile": "h100"},
                    "max_model_len": 4096, "max_num_seqs": 64,
                    "kv_events_config": {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"},
                    "kv_events": f"tcp://127.0.0.1:{port}"} for i, port in enumerate(ports)]
    settings = Settings(models=[{"name": "design", "routing": {"policy": "cache_aware", "block_size": 16},
                                 "deployments": deployments}])
    gateway = Gateway.from_settings(settings)
    with serve_app(create_app(gateway), port=http) as url:
        yield url, gateway


@pytest.fixture
def client(fleet):
    return OpenAI(base_url=f"{fleet[0]}/v1", api_key="unused", max_retries=0)


def _samples(url: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_a_completion_runs_to_max_tokens_with_its_usage(client):
    reply = client.completions.create(model="design", prompt="The sea is", max_tokens=12)
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].text
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens > 0


def test_a_chat_streams_token_by_token(client):
    stream = client.chat.completions.create(model="design", messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=8, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) == 8  # one event per simulated step
    assert chunks[-1].usage.completion_tokens == 8


@pytest.mark.parametrize("extra, field", [({"logprobs": True}, "logprobs"),
                                          ({"response_format": {"type": "json_object"}}, "response_format"),
                                          ({"n": 2}, "n")])
def test_what_needs_a_models_logits_is_refused_naming_the_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="design", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       **extra)
    assert error.value.status_code == 400 and error.value.body["param"] == field


def test_tokenize_and_health_answer_as_on_a_real_replica(fleet):
    url, _ = fleet
    tokens = httpx.post(f"{url}/tokenize", json={"model": "design", "prompt": "The sea is blue"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert httpx.get(f"{url}/health").status_code == 200


def test_metrics_carry_vllms_names_and_the_kv_events_reach_the_router(fleet, client):
    url = fleet[0]
    system = "You answer in one short sentence about the weather and nothing else. " * 8
    for _ in range(3):
        client.completions.create(model="design", prompt=system + "Is it raining?", max_tokens=4)
    samples = _samples(url)
    types = [line.split()[2] for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))  # each family once: vLLM's names beside ours, never twice
    engines = {s.labels["engine"] for s in samples["vllm:num_requests_running"]}
    assert engines == {"replica-0", "replica-1"}
    assert {s.labels["model_name"] for s in samples["vllm:kv_cache_usage_perc"]} == {"design"}
    assert sum(s.value for s in samples["vllm:prompt_tokens_total"]) > 0
    assert sum(s.value for s in samples["vllm:prefix_cache_hits_total"]) > 0  # the shared prompt, cached
    precise = {s.labels["backend"]: s.value for s in samples["burstgate:prefix_index_precise"]}
    assert 1.0 in precise.values()  # the replica that took the prompt published its blocks
    info = httpx.get(f"{url}/info").json()
    engine = info["models"][0]["deployments"][0]["engine"]
    assert engine["kernels"].startswith("simulated: h100") and engine["weight_bytes"] > 20e9


def test_serve_simulate_makes_a_simulated_deployment_and_refuses_unknown_profiles():
    settings = build_settings(None, Path(DESIGN), simulate="h200")
    assert settings.models[0].deployments[0].simulate.profile == "h200"
    import typer

    with pytest.raises(typer.BadParameter, match="unknown profile"):
        build_settings(None, Path(DESIGN), simulate="tpu-v5")


def test_a_profile_file_that_is_no_profile_is_refused_where_the_config_is_read(tmp_path):
    import typer

    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x"}')
    with pytest.raises(typer.BadParameter, match="is not a device profile"):
        build_settings(None, Path(DESIGN), simulate=str(bad))
