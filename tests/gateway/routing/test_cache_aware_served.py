"""cache_aware routing through a real gateway in front of two native engines that publish their KV events: each
conversation's turns land where its history is cached, the engines' prefix caches are hit, and the index follows
the engines' events."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.config import Settings
from gateway.service import Gateway
from tests.servers import free_ports, serve_app


@pytest.fixture(scope="module")
def fleet():
    *ports, http = free_ports(3)  # together: the engines bind their events' ports at the app's start-up
    deployments = [{"kind": "native", "name": f"replica-{i}", "dtype": "float32", "max_model_len": 1024,
                    "num_blocks": 64, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512,
                    "kv_events_config": {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"},
                    "kv_events": f"tcp://127.0.0.1:{port}"} for i, port in enumerate(ports)]
    settings = Settings(models=[{"name": "m", "routing": {"policy": "cache_aware", "load_cost_tokens": 64},
                                 "deployments": deployments}])
    gateway = Gateway.from_settings(settings)
    with serve_app(create_app(gateway), port=http) as url:
        yield url, gateway


def _metric(url: str, name: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_conversations_stay_with_their_history_and_hit_the_engines_prefix_caches(fleet):
    url, gateway = fleet
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    system = {"role": "system", "content": "You answer in one short sentence. " * 8}
    homes = {}
    for user in ("ann", "bob", "cid", "dee"):
        messages = [system, {"role": "user", "content": f"I am {user}. Tell me about the sea."}]
        for _ in range(3):
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "And then?"}]
        homes[user] = messages
    decisions = _metric(url, "burstgate:routing_decisions_total")
    by_reason = {}
    for labels, value in decisions.items():
        by_reason[dict(labels)["reason"]] = by_reason.get(dict(labels)["reason"], 0) + value
    assert by_reason.get("prefix_hit", 0) >= 8  # turns 2 and 3 of every conversation
    engines = [d.backend.engine for d in gateway.groups["m"].deployments]
    stats = [e.stats() for e in engines]
    assert sum(s.prefix_cache_hits for s in stats) > 0.4 * sum(s.prefix_cache_queries for s in stats)
    precise = _metric(url, "burstgate:prefix_index_precise")
    assert precise and all(v == 1 for v in precise.values())  # the engines' events arrived
    assert _metric(url, "burstgate:routing_load_cost_tokens") == {(("model", "m"),): 64.0}


def test_the_index_forgets_what_an_engine_clears(fleet):
    _, gateway = fleet
    group = gateway.groups["m"]
    replica = group.deployments[0]
    engine = replica.backend.engine
    import time

    for _ in range(100):  # wait for earlier requests to leave the engine
        if not engine.has_unfinished():
            break
        time.sleep(0.05)
    engine.blocks.reset_prefix_cache()
    engine.step()  # publishes AllBlocksCleared
    for _ in range(100):
        if group.policy.index.size(replica.name) == 0:
            break
        time.sleep(0.05)
    assert group.policy.index.size(replica.name) == 0
