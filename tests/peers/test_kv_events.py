"""KV-cache events across the field, both ways (the routing issue's interoperability): the gateway's index reads
what real vLLM 0.32 publishes (``--kv-events-config``), and vllm-router's ``kv_aware`` policy reads what the native
engine publishes, so a conversation's later turns are placed on the replica whose cache holds it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from backends.kv_events import BlockStored, decode_events
from backends.native.block_hash import block_hashes
from benchmarks.fleet_routing import ROUTERS_PYTHON
from benchmarks.peers import VLLM_PYTHON
from gateway.routing.prefix_index import PrefixIndex
from tests.servers import Served, free_ports, replicas_with_kv_events

pytestmark = pytest.mark.skipif(os.environ.get("BURSTGATE_PEERS") != "1" or not VLLM_PYTHON.exists(),
                                reason="peer suite: run `make test-peers`")
PROMPT = "The harbour master kept a long ledger of every ship that came and went. " * 40


def _stored_events(endpoint: str, send) -> list[BlockStored]:
    """The BlockStored events published at ``endpoint`` while ``send()`` runs, read with the gateway's reader."""
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt_string(zmq.SUBSCRIBE, "kv")
    socket.connect(endpoint)
    time.sleep(0.5)  # a subscriber joins late: give it time before the first message
    try:
        send()
        events: list = []
        while socket.poll(3000):
            events += decode_events(socket.recv_multipart()[2])
        return [e for e in events if isinstance(e, BlockStored)]
    finally:
        socket.close(linger=0)


def test_the_gateways_index_reads_real_vllms_events(vllm_url, vllm_kv_events):
    prompt = {"model": "smollm2", "prompt": PROMPT}
    stored = _stored_events(vllm_kv_events, lambda: httpx.post(f"{vllm_url}/v1/completions", timeout=300, json={
        **prompt, "max_tokens": 2, "temperature": 0}).raise_for_status())
    tokens = httpx.post(f"{vllm_url}/tokenize", json=prompt, timeout=60).json()["tokens"]
    assert stored, "no BlockStored read from vLLM's events"
    size = stored[0].block_size
    held = [t for e in stored for t in e.token_ids]
    assert held == tokens[:len(held)] and len(held) == len(tokens) // size * size  # every full block, in order
    index = PrefixIndex(capacity_blocks=1024)
    for e in stored:
        index.stored("vllm", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size)
    assert index.match("vllm", block_hashes(tokens, size)) == len(tokens) // size


@pytest.fixture
def replicas(tmp_path) -> Iterator[list[tuple[Served, int]]]:
    with replicas_with_kv_events(tmp_path) as started:
        yield started


def _until_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, f"{url} did not become healthy"
        time.sleep(0.3)


def _samples(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url, timeout=10).text
    return {str(s.labels): s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


@pytest.mark.skipif(not ROUTERS_PYTHON.exists(), reason="no router venv: run `make peers-routers`")
def test_vllm_routers_kv_aware_policy_reads_the_native_engines_events(replicas, tmp_path):
    port, metrics = free_ports(2)
    sources = [arg for served, events in replicas
               for arg in ("--kv-event-source", f"{served.url}=tcp://127.0.0.1:{events}")]
    log = (tmp_path / "vllm-router.log").open("w")
    router = subprocess.Popen([str(ROUTERS_PYTHON.parent / "vllm-router"), "--policy", "kv_aware", "--host",
                               "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics), "--worker-urls",
                               *[served.url for served, _ in replicas], *sources, "--kv-event-block-size", "16",
                               "--kv-event-model", "m"], stdout=log, stderr=subprocess.STDOUT)
    try:
        _until_healthy(f"http://127.0.0.1:{port}")
        for user in ("Ann", "Bob"):
            messages = [{"role": "system", "content": PROMPT[:400]}, {"role": "user", "content": f"I am {user}."}]
            for _ in range(3):
                reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
                    "model": "m", "messages": messages, "max_tokens": 6, "temperature": 0}).json()
                messages += [reply["choices"][0]["message"], {"role": "user", "content": "Go on."}]
        lookups = _samples(f"http://127.0.0.1:{metrics}/metrics", "vllm_router_kv_placement_lookups_total")
    finally:
        router.terminate()
        router.wait(timeout=30)
    assert "tagged map" not in (tmp_path / "vllm-router.log").read_text()  # the events decode
    hits = sum(v for labels, v in lookups.items() if "'hit'" in labels)
    assert hits >= 5  # every request but the very first found its prefix in the events' index
