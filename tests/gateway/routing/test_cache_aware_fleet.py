"""cache_aware in front of a fleet of separate engine servers (two `burstgate serve` processes, each one native
engine publishing its KV events), as ops run it: two gateway replicas following the same events route as one
gateway does (the client alternating between them finds the caches as often), and a replica killed mid-run
costs no request: the gateway retries on the other one, forgets the dead one's blocks, and routes to it again
once it is back with an empty cache."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.config import Settings
from gateway.service import Gateway
from tests.servers import Served, replica_with_kv_events, replicas_with_kv_events, serve_app, start_burstgate


def _system(job: str) -> dict:
    return {"role": "system", "content": f"You are a ship's {job}. You answer in one short sentence. " * 6}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> Iterator[list[tuple[Served, int]]]:
    with replicas_with_kv_events(tmp_path_factory.mktemp("replicas")) as started:
        yield started


def _front(replicas: list[tuple[Served, int]], **resilience) -> Gateway:
    deployments = [{"kind": "openai", "name": f"replica-{i}", "url": f"{served.url}/v1", "upstream_model": "m",
                    "kv_events": f"tcp://127.0.0.1:{port}"} for i, (served, port) in enumerate(replicas)]
    return Gateway.from_settings(Settings(models=[{"name": "m", "routing": "cache_aware", "deployments": deployments}],
                                          resilience=resilience))


def _engine_counts(replicas) -> tuple[float, float]:
    """Prompt tokens the replicas' prefix caches were asked for and found, summed over the fleet."""
    queries = hits = 0.0
    for served, _ in replicas:
        for family in text_string_to_metric_families(httpx.get(f"{served.url}/metrics").text):
            for s in family.samples:
                if s.name == "burstgate:prefix_cache_queries_total":
                    queries += s.value
                elif s.name == "burstgate:prefix_cache_hits_total":
                    hits += s.value
    return queries, hits


def _converse(clients: list[OpenAI], users: list[str], system: dict, turns: int = 3, think_s: float = 0.0) -> None:
    """Each user's turns sent in turn through ``clients``, one after the other (a client per turn, cycling),
    ``think_s`` between an answer and the next question."""
    for user in users:
        log = " ".join(f"On day {day} {user} sailed {day * 7 % 31} miles." for day in range(1, 16))  # ~200 tokens
        messages = [system, {"role": "user", "content": f"I am {user}. My log: {log} What is for dinner at sea?"}]
        for turn in range(turns):
            if turn:
                time.sleep(think_s)
            client = clients[turn % len(clients)]
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": f"And after that, {user}?"}]


def _hit_rate(replicas, users: list[str], system: dict, gateways: list[Gateway]) -> float:
    """The fleet's prefix-cache hit rate over ``users``' conversations sent through ``gateways``, which must have
    followed every replica's KV events by the end. A person thinks between turns (0.2 s here): the engines' KV
    events of one turn reach the other gateway before the next turn does, as they do within a fraction of that
    (a turn sent the instant the last answered could beat its own blocks' events to the other gateway)."""
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serve_app(create_app(g))) for g in gateways]
        clients = [stack.enter_context(OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)) for url in urls]
        before = _engine_counts(replicas)
        _converse(clients, users, system, think_s=0.2)
        after = _engine_counts(replicas)
        assert all(g.groups["m"].policy.index_precise(d) for g in gateways for d in g.groups["m"].deployments)
    return (after[1] - before[1]) / (after[0] - before[0])


def test_two_gateway_replicas_find_the_caches_as_often_as_one(replicas):
    """The client alternates between two gateways turn by turn; both follow the same engines' events and read the
    same engine load, so the fleet's prefix-cache hit rate stays within 5 points of one gateway's."""
    one = _hit_rate(replicas, ["ann", "bob", "cid", "dee", "eve", "fay"], _system("cook"), [_front(replicas)])
    two = _hit_rate(replicas, ["gus", "hal", "ivy", "jon", "kim", "lou"], _system("pilot"),
                    [_front(replicas), _front(replicas)])
    assert one > 0.5  # the later turns find their history, the first ones the shared system prompt
    assert abs(two - one) <= 0.05, (one, two)


def test_a_replica_killed_mid_run_fails_only_what_it_was_answering_and_is_routed_to_again_once_back(replicas,
                                                                                                      tmp_path):
    """Requests the dead replica had begun answering fail (their first token was sent: vLLM's rule, no retry);
    every later one is retried or routed to the live replica; its blocks leave the index; back, it takes
    conversations again."""
    gateway = _front(replicas, health_interval_s=0.2, health_timeout_s=1.0, retries=2)
    group = gateway.groups["m"]
    failures: list[float] = []
    done: list[float] = []
    with serve_app(create_app(gateway)) as url, OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        stop = threading.Event()

        def traffic(name: str) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    _converse([c], [f"{name}-{n}"], _system("captain"), turns=2)
                    done.append(time.monotonic())
                except Exception:  # each failure is counted: that is the test
                    failures.append(time.monotonic())

        senders = [threading.Thread(target=traffic, args=(f"user{i}",)) for i in range(2)]
        for t in senders:
            t.start()
        time.sleep(3)
        victim, events_port = replicas[1]
        victim.proc.kill()  # SIGKILL: no drain, connections cut
        victim.proc.wait(timeout=30)
        dead = group.deployments[1]
        deadline = time.monotonic() + 30
        while dead.healthy or group.policy.index.size(dead.name):
            assert time.monotonic() < deadline, "the dead replica is still routed to, or its blocks still indexed"
            time.sleep(0.1)
        noticed = time.monotonic()
        time.sleep(3)  # traffic on the one replica left
        assert any(t > noticed for t in done)
        replicas[1] = (start_burstgate(*replica_with_kv_events(tmp_path, events_port), port=victim.port),
                       events_port)  # back, with an empty cache
        deadline = time.monotonic() + 60
        while not (dead.healthy and group.policy.index.size(dead.name)):  # healthy, and taking conversations again
            assert time.monotonic() < deadline, "the replica is not routed to once back"
            time.sleep(0.2)
        stop.set()
        for t in senders:
            t.join(timeout=120)
    assert len(failures) <= len(senders)  # at most the one conversation each sender had on the victim
    assert all(t <= noticed for t in failures)  # none once the gateway knew
