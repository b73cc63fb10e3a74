"""System sampling during a run: GPU memory/utilisation (NVML), a local server's CPU and RSS (psutil), the
server's own KV-cache usage and GPU memory from its /metrics while the run goes (a burstgate server exports its
GPUs' memory, so a remote one's is charted too), and its /metrics before and after."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gateway.info import describe, devices
from loadtest.extras import require

SAMPLING = "sampling the server's CPU and memory"
TREE_REFRESH_S = 5.0  # how often the server's child processes are listed again
STEP_SLACK = 0.1  # share of an interval a sleep may end early by and still count as the whole interval


@dataclass
class Sample:
    t: float
    cpu_percent: float | None = None  # of one core, summed over the process tree
    rss_bytes: int | None = None
    gpu_memory_used: list[int] = field(default_factory=list)  # bytes per device
    gpu_util_percent: list[int] = field(default_factory=list)
    kv_cache_usage: float | None = None  # the server's fraction of KV blocks in use (the fullest engine's)


# The servers' KV-cache usage gauges (0..1): vLLM's, then burstgate's.
KV_USAGE_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "burstgate:kv_cache_usage_perc")


def client_hardware() -> dict:
    """The load tester's own machine (the server's comes from its GET /info, or is declared)."""
    devs = devices()
    return {"hardware": describe(devs), "devices": devs}


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no library, no driver, or no GPU: sample CPU only
        return None


def find_server_process(pid: int | None = None, port: int | None = None):
    """The ``psutil.Process`` listening on ``port`` (or with ``pid``), if it runs on this machine."""
    psutil = require("psutil", SAMPLING)
    if pid is not None:
        return psutil.Process(pid)
    if port is not None:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return psutil.Process(conn.pid)
    return None


class Sampler:
    """Samples every ``interval_s`` in the background until stopped, the server's /metrics every
    ``metrics_interval_s``.

    On a machine the server shares, the sampler's CPU is taken from the server: each scrape costs the server CPU
    to render its metrics and the client more to parse them, enough to slow a 2-core vLLM measurably
    (docs/performance.md). So only the gauges charted are parsed, the metrics are read less often than the
    process, and the server's process tree is looked up again only every ``TREE_REFRESH_S``."""

    def __init__(self, process, interval_s: float = 0.5, metrics: tuple[aiohttp.ClientSession, str] | None = None,
                 metrics_interval_s: float = 1.0) -> None:  # a psutil.Process, or None; (client, server URL)
        self.process, self.interval_s, self.metrics = process, interval_s, metrics
        self.metrics_interval_s = metrics_interval_s
        self._psutil = require("psutil", SAMPLING) if process is not None else None
        self.samples: list[Sample] = []
        self._known: dict[int, object] = {}  # pid -> psutil.Process of the server's tree
        self._tree_at = -math.inf
        self._nvml = _nvml()
        self._task: asyncio.Task | None = None
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._t0 = time.perf_counter()
        if self.process is not None:
            self._cpu_percent()  # the first call primes psutil's counters
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> list[Sample]:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return self.samples

    async def _loop(self) -> None:
        scraped_at = -math.inf
        while True:
            await asyncio.sleep(self.interval_s)
            sample = self.sample()
            if self.metrics is not None and sample.t - scraped_at >= self.metrics_interval_s * (1 - STEP_SLACK):
                scraped_at = sample.t
                scraped = await scrape_metrics(*self.metrics, names=CHARTED_GAUGES)
                sample.kv_cache_usage = kv_cache_usage(scraped)
                if served := gpu_memory_used(scraped):  # the server's own GPUs, wherever it runs
                    sample.gpu_memory_used = served
            self.samples.append(sample)

    def sample(self) -> Sample:
        s = Sample(time.perf_counter() - self._t0)
        if self.process is not None and self._psutil is not None:  # set together
            try:
                s.cpu_percent = self._cpu_percent()
                s.rss_bytes = int(self._summed(lambda p: p.memory_info().rss))
            except self._psutil.Error:  # the server itself has ended
                self.process = None
        if self._nvml is not None:
            n = self._nvml
            for i in range(n.nvmlDeviceGetCount()):
                h = n.nvmlDeviceGetHandleByIndex(i)
                s.gpu_memory_used.append(int(n.nvmlDeviceGetMemoryInfo(h).used))
                s.gpu_util_percent.append(int(n.nvmlDeviceGetUtilizationRates(h).gpu))
        return s

    def _tree(self) -> list:
        """The server process and its children (vLLM's engine core is one), each kept as one psutil object
        from sample to sample: a process's CPU percent is measured since that object's previous call, so a
        fresh object would read 0 every time. Listing the children walks every process of the machine, so the
        tree is looked up again only every ``TREE_REFRESH_S``."""
        if (now := time.monotonic()) - self._tree_at >= TREE_REFRESH_S:
            alive = [self.process, *self.process.children(recursive=True)]
            self._known = {p.pid: self._known.get(p.pid, p) for p in alive}
            self._tree_at = now
        return list(self._known.values())

    def _cpu_percent(self) -> float:
        return self._summed(lambda p: p.cpu_percent(None))

    def _summed(self, read: Callable[[Any], float]) -> float:
        """``read`` summed over the server's tree; a child that has ended since the tree was listed is left out,
        and the tree listed again at the next sample (the server's own end is the caller's to handle)."""
        assert self._psutil is not None  # set with the process
        total = 0.0
        for p in self._tree():
            try:
                total += read(p)
            except self._psutil.Error:
                if p.pid == self.process.pid:
                    raise
                self._tree_at = -math.inf
        return total


def kv_cache_usage(samples: dict[str, float]) -> float | None:
    """The fullest engine's KV-cache usage (0..1) from scraped metrics; None when the server exports none."""
    for name in KV_USAGE_GAUGES:
        values = [v for k, v in samples.items() if k == name or k.startswith(name + "{")]
        if values:
            return max(values)
    return None


GPU_MEMORY_GAUGE = "burstgate:gpu_memory_used_bytes"
CHARTED_GAUGES = (*KV_USAGE_GAUGES, GPU_MEMORY_GAUGE)  # what the sampler reads from /metrics during a run


def gpu_memory_used(samples: dict[str, float]) -> list[int]:
    """The server's GPU memory in use (bytes per GPU, by index) from scraped metrics; empty when it exports none."""
    by_gpu = {}
    for key, value in samples.items():
        if key.startswith(GPU_MEMORY_GAUGE + "{"):
            index = key.split('gpu="', 1)[1].split('"', 1)[0]
            by_gpu[int(index)] = int(value)
    return [by_gpu[i] for i in sorted(by_gpu)]


async def scrape_metrics(client: aiohttp.ClientSession, url: str, names: tuple[str, ...] | None = None
                         ) -> dict[str, float]:
    """The target's Prometheus samples (name{labels} → value); empty when it has no /metrics. With ``names``,
    only the samples of those metrics: the rest of the text (vLLM's is mostly histograms) is skipped unparsed."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with client.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return {}
            text = await r.text()
        if names is not None:
            text = "\n".join(line for line in text.splitlines() if line.startswith(names))
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return {}
