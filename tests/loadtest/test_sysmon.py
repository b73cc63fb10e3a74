"""Sampling during a run: the server's KV-cache usage and GPU memory gauges are read from its /metrics while the
run goes, less often than its process, and only the charted gauges are parsed."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.metrics import GatewayMetrics
from loadtest.sysmon import CHARTED_GAUGES, Sampler, gpu_memory_used, kv_cache_usage, scrape_metrics
from tests.servers import serve_app


async def _sample(url: str, metrics_interval_s: float = 0.05) -> list:
    """What a sampler sampling every 50 ms, reading ``url``'s /metrics every ``metrics_interval_s``, took in 0.4 s."""
    async with aiohttp.ClientSession() as client:
        sampler = Sampler(None, 0.05, (client, url), metrics_interval_s)
        sampler.start()
        await asyncio.sleep(0.4)
        return await sampler.stop()


def test_kv_cache_usage_is_the_fullest_engines_from_vllms_or_burstgates_gauge():
    assert kv_cache_usage({'vllm:kv_cache_usage_perc{engine="0"}': 0.2,
                           'vllm:kv_cache_usage_perc{engine="1"}': 0.7}) == 0.7
    assert kv_cache_usage({"burstgate:kv_cache_usage_perc": 0.3, "other": 1.0}) == 0.3
    assert kv_cache_usage({"other": 1.0}) is None


def test_the_sampler_reads_the_gauge_while_the_run_goes():
    usage = iter([0.1, 0.4, 0.9] + [0.9] * 100)

    async def metrics(_):
        return PlainTextResponse(f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc {next(usage)}\n")

    with serve_app(Starlette(routes=[Route("/metrics", metrics)])) as url:
        samples = asyncio.run(_sample(url))
    assert [s.kv_cache_usage for s in samples[:3]] == [0.1, 0.4, 0.9]


def test_the_servers_metrics_are_read_less_often_than_its_process():
    """Each scrape costs the server CPU (vLLM: ~5 ms) that a server sharing the client's cores loses: the sampler
    reads /metrics on its own, slower clock, and the samples in between carry no KV-cache usage."""
    scrapes = []

    async def metrics(_):
        scrapes.append(1)
        return PlainTextResponse(f"vllm:kv_cache_usage_perc {0.1 * len(scrapes)}\n")

    with serve_app(Starlette(routes=[Route("/metrics", metrics)])) as url:
        samples = asyncio.run(_sample(url, metrics_interval_s=0.15))
    read = [s.kv_cache_usage for s in samples if s.kv_cache_usage is not None]
    assert read == pytest.approx([0.1 * (i + 1) for i in range(len(scrapes))])
    assert 2 <= len(scrapes) <= len(samples) // 2, (len(scrapes), len(samples))


def test_only_the_charted_gauges_are_parsed():
    text = ('# HELP vllm:kv_cache_usage_perc usage\n# TYPE vllm:kv_cache_usage_perc gauge\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            '# TYPE vllm:time_to_first_token_seconds histogram\n'
            'vllm:time_to_first_token_seconds_bucket{le="0.1"} 3.0\n'
            'burstgate:gpu_memory_used_bytes{gpu="1",name="H100"} 2e9\nburstgate:gpu_memory_used_bytes{gpu="0",name="H100"} 1e9\n'
            'vllm:num_requests_running 4.0\n')

    async def metrics(_):
        return PlainTextResponse(text)

    async def scrape(url: str, names) -> dict:
        async with aiohttp.ClientSession() as client:
            return await scrape_metrics(client, url, names=names)

    with serve_app(Starlette(routes=[Route("/metrics", metrics)])) as url:
        charted, everything = asyncio.run(scrape(url, CHARTED_GAUGES)), asyncio.run(scrape(url, None))
    assert len(everything) == 5 and charted == {k: v for k, v in everything.items() if k.startswith(CHARTED_GAUGES)}
    assert len(charted) == 3
    assert kv_cache_usage(charted) == 0.25 and gpu_memory_used(charted) == [1_000_000_000, 2_000_000_000]


def test_the_sampler_charts_a_remote_burstgates_gpu_memory_from_its_metrics():
    """A burstgate server exports each GPU's memory in use (burstgate:gpu_memory_used_bytes, by GPU index): the
    sampler reads it there, so a server on another machine has its GPU memory charted too. The exposition is the
    gateway's own (GatewayMetrics), fed the GPUs a machine here does not have."""
    from prometheus_client import generate_latest

    used = iter([(40e9, 2e9), (41e9, 3e9)] + [(42e9, 4e9)] * 100)

    def gpus():
        first, second = next(used)
        return [("NVIDIA H100 80GB HBM3", int(first)), ("NVIDIA H100 80GB HBM3", int(second))]

    exported = GatewayMetrics(gpu_memory=gpus)

    async def metrics(_):
        return PlainTextResponse(generate_latest(exported.registry).decode())

    with serve_app(Starlette(routes=[Route("/metrics", metrics)])) as url:
        samples = asyncio.run(_sample(url))
    assert [s.gpu_memory_used for s in samples[:2]] == [[40_000_000_000, 2_000_000_000],
                                                        [41_000_000_000, 3_000_000_000]]


def test_a_server_without_gpus_exports_the_gauge_without_samples():
    from prometheus_client import generate_latest

    from gateway.info import gpu_memory_used as this_machines

    if this_machines():
        pytest.skip("this machine has GPUs")
    text = generate_latest(GatewayMetrics().registry).decode()  # this machine: no GPU
    assert "# TYPE burstgate:gpu_memory_used_bytes gauge" in text
    assert gpu_memory_used({"burstgate:asyncio_tasks": 3.0}) == []
    assert not [line for line in text.splitlines() if line.startswith("burstgate:gpu_memory_used_bytes")]


def _sample_a_parent_and_its_child(child: str, seconds: float, parent_after: str = "") -> tuple[list, list]:
    """A process whose child runs ``child`` (then the parent runs ``parent_after``), sampled every 0.2 s for
    ``seconds`` from once the child is up: the samples, and the parent's children at the end."""
    import subprocess
    import sys

    import psutil

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               f"subprocess.run([sys.executable, '-c', {child!r}]); {parent_after}"])
    try:
        process = psutil.Process(parent.pid)
        while not process.children():
            pass

        async def sample() -> list:
            sampler = Sampler(process, 0.2)
            sampler.start()
            await asyncio.sleep(seconds)
            return await sampler.stop()

        samples = asyncio.run(sample())
        left = process.children()
    finally:
        for child_process in psutil.Process(parent.pid).children(recursive=True):
            child_process.kill()
        parent.kill()
        parent.wait()
    return samples, left


def test_a_servers_child_processes_count_towards_its_cpu():
    # the server process idles while its child (as vLLM's engine core) spins: the tree's CPU is the child's
    samples, _ = _sample_a_parent_and_its_child("while True: pass", 1.3)
    assert max(s.cpu_percent for s in samples[1:]) > 50, [s.cpu_percent for s in samples]


def test_a_child_that_ends_mid_run_does_not_end_the_sampling():
    # the tree is listed every few seconds, not every sample: a child found then and gone since is left out
    samples, left = _sample_a_parent_and_its_child("import time; time.sleep(0.6)", 1.5, parent_after="time.sleep(30)")
    assert not left  # the child has ended
    assert len(samples) >= 5 and all(s.cpu_percent is not None and s.rss_bytes for s in samples), samples
