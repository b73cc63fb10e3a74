"""Replica churn under cache-aware routing: two engine replicas (``burstgate serve --simulate``: the native
scheduler and block manager, publishing their KV events) are stopped and started again in turn, as a rolling update
does, while chat sessions go on turn after turn through the gateway. No request is lost, sessions carry on on the
replica that stays, and the routing index of a restarted replica starts again from its empty cache, then follows
its new engine's events.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
import yaml
from openai import OpenAI

from gateway.app import create_app
from gateway.config import DEFAULT_MODEL_NAME, Settings
from gateway.service import Gateway
from tests.servers import free_ports, serve_app, start_burstgate, start_burstgates

SYSTEM = {"role": "system", "content": "You are a patient guide to the sea and its creatures. " * 6}


DRAIN = {"BURSTGATE_SERVER__DRAIN_TIMEOUT_S": "60"}


def replica_options(tmp_path, port: int, kv_port: int) -> list[str]:
    """The options of a simulated replica publishing its KV events on ``kv_port``."""
    config = tmp_path / f"replica-{port}.yaml"
    config.write_text(yaml.safe_dump({"models": [{"name": DEFAULT_MODEL_NAME, "deployments": [{
        "kind": "native", "block_size": 16, "max_model_len": 2048,
        "kv_events_config": {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{kv_port}"}}]}]}))
    return ["--config", str(config), "--simulate", "cpu-epyc-2c"]


@pytest.fixture
def replicas(tmp_path):
    free = free_ports(4)
    ports = list(zip(free[::2], free[1::2]))  # (HTTP, KV events) of each replica
    running = start_burstgates(*(replica_options(tmp_path, port, kv_port) for port, kv_port in ports),
                               ports=[port for port, _ in ports], env=DRAIN)
    yield running, ports
    for replica in running:
        replica.proc.terminate()
        replica.proc.wait(timeout=120)


def session(url: str, name: str, stop: threading.Event, failures: list, turns: list) -> None:
    """Turns of a chat until ``stop``: each one's history grows; a new conversation after 5 turns."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    while not stop.is_set():
        messages = [SYSTEM, {"role": "user", "content": f"I am {name}. What lives in a reef?"}]
        for _ in range(5):
            try:
                reply = client.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0)
            except Exception as exc:  # a lost request
                failures.append(repr(exc))
                return
            turns.append(name)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "Tell me more."}]


def served(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("burstgate:requests_total{") and 'status="ok"' in line:
            backend = line.split('backend="')[1].split('"')[0]
            out[backend] = float(line.rsplit(" ", 1)[1])
    return out


def test_replicas_restarted_in_turn_lose_no_request_and_their_index_starts_again(tmp_path, replicas):
    running, ports = replicas
    deployments = [{"kind": "openai", "name": f"replica-{i}", "url": f"http://127.0.0.1:{port}/v1",
                    "upstream_model": DEFAULT_MODEL_NAME, "kv_events": f"tcp://127.0.0.1:{kv_port}"}
                   for i, (port, kv_port) in enumerate(ports)]
    settings = Settings(models=[{"name": "m", "deployments": deployments, "routing": {
        "policy": "cache_aware", "block_size": 16}}],
        resilience={"health_interval_s": 0.5, "health_timeout_s": 2})
    gateway = Gateway.from_settings(settings)
    group = gateway.groups["m"]
    stop, failures, turns = threading.Event(), [], []
    with serve_app(create_app(gateway)) as url:
        sessions = [threading.Thread(target=session, args=(url, f"user-{i}", stop, failures, turns))
                    for i in range(4)]
        for t in sessions:
            t.start()
        try:
            for i, (port, kv_port) in enumerate(ports):
                d = group.deployments[i]
                while group.policy.index_blocks(d) == 0 or not group.policy.index_precise(d):
                    time.sleep(0.2)  # it holds sessions' blocks, known from its own events
                held = group.policy.index_blocks(d)
                before = served(url)
                running[i].proc.send_signal(signal.SIGTERM)  # drains, then exits
                assert running[i].proc.wait(timeout=120) in (0, -signal.SIGTERM)
                while d.healthy:
                    time.sleep(0.1)
                assert group.policy.index_blocks(d) == 0  # its cache went with its process
                running[i] = start_burstgate(*replica_options(tmp_path, port, kv_port), port=port, env=DRAIN)
                while not d.healthy:
                    time.sleep(0.1)
                other = group.deployments[1 - i].name
                assert served(url).get(other, 0) > before.get(other, 0)  # sessions carried on meanwhile
                deadline = time.monotonic() + 60
                while not (group.policy.index_precise(d) and group.policy.index_blocks(d) > 0):
                    assert time.monotonic() < deadline, "the restarted replica's index did not follow its events"
                    time.sleep(0.2)
                assert held > 0
                back = served(url).get(d.name, 0)
                deadline = time.monotonic() + 60
                while served(url).get(d.name, 0) <= back:  # routed to again
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
        finally:
            stop.set()
            for t in sessions:
                t.join(timeout=180)
    assert failures == []  # no request lost
    assert len(turns) >= 20
