"""Every Prometheus metric the gateway exports, defined in one place (names in vLLM's ``vllm:*`` style).

Each app gets its own registry, so several gateways can live in one process (tests, benchmarks).
In-process engines' live figures are read at scrape time by a collector, never copied on a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from backends.base import EngineStats
from gateway.info import gpu_memory_used

# Buckets as vLLM uses for TTFT / ITL / E2E.
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class GatewayMetrics:
    def __init__(self, gpu_memory: Callable[[], list[tuple[str, int]]] | None = None) -> None:
        """``gpu_memory``: each GPU's (name, bytes in use), read at every scrape (default: this machine's, from
        gateway/info.py)."""
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ("model", "backend")
        self.requests = Counter("burstgate:requests", "Requests finished, by outcome.",
                                (*labels, "status"), registry=r)
        self.ttft = Histogram("burstgate:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT, registry=r)
        self.itl = Histogram("burstgate:inter_token_latency_seconds", "Time between streamed chunks.", labels,
                             buckets=_ITL, registry=r)
        self.e2e = Histogram("burstgate:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=_E2E, registry=r)
        self.prompt_tokens = Counter("burstgate:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=r)
        self.generation_tokens = Counter("burstgate:generation_tokens", "Generated tokens.", labels, registry=r)
        self.in_flight = Gauge("burstgate:requests_in_flight", "Requests being served now.", labels, registry=r)
        self.backend_healthy = Gauge("burstgate:backend_healthy", "1 when the backend passed its last check.",
                                     ("backend",), registry=r)
        self.retries = Counter("burstgate:retries", "Attempts that failed before the first token and were tried again (labels: the failed one).",
                               ("model", "backend", "kind"), registry=r)
        self.fallbacks = Counter("burstgate:fallbacks", "Requests sent on to a fallback model.",
                                 ("model", "fallback"), registry=r)
        self.breaker_state = Gauge("burstgate:breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.",
                                   ("backend",), registry=r)
        self.rate_limited = Counter("burstgate:rate_limited_requests", "Requests refused by a key's limit.",
                                    ("key",), registry=r)
        self.routing_decisions = Counter("burstgate:routing_decisions", "Requests routed, by the policy's reason "
                                         "(prefix_hit, no_prefix, load_guard, kv_guard, ...).",
                                         ("model", "backend", "reason"), registry=r)
        self.prefix_index_blocks = Gauge("burstgate:prefix_index_blocks", "KV blocks the routing index says a "
                                         "deployment holds.", ("model", "backend"), registry=r)
        self.prefix_index_precise = Gauge("burstgate:prefix_index_precise", "1 while the routing index follows the "
                                          "engine's KV events, 0 when it is kept from routing decisions alone.",
                                          ("model", "backend"), registry=r)
        self.routing_load_cost_tokens = Gauge("burstgate:routing_load_cost_tokens", "Uncached prompt tokens the "
                                              "routing policy weighs one request of load against (cache_aware's "
                                              "load_cost_tokens, as configured or as auto learnt it).",
                                              ("model",), registry=r)
        # Leaks show here first (the soak suite reads them): memory and descriptors of the process, and the
        # asyncio tasks alive in the serving loop.
        ProcessCollector(registry=r)
        Gauge("burstgate:asyncio_tasks", "asyncio tasks alive in the serving loop.",
              registry=r).set_function(_asyncio_tasks)
        r.register(_GpuCollector(gpu_memory or gpu_memory_used))

    def forget_deployment(self, model: str, name: str) -> None:
        """A discovered replica gone: its gauges go (it is neither healthy nor busy any more); its counters stay,
        so that rates over a window that saw it stay right."""
        for gauge, labels in ((self.backend_healthy, (name,)), (self.breaker_state, (name,)),
                              (self.in_flight, (model, name)), (self.prefix_index_blocks, (model, name)),
                              (self.prefix_index_precise, (model, name))):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)


    def watch_engines(self, engines: Callable[[], Iterable[tuple[str, str, EngineStats]]]) -> None:
        """Export the live figures of in-process engines; ``engines`` yields (model, backend, stats)."""
        self.registry.register(_EngineCollector(engines))


    def watch_models(self, models: Callable[[], Iterable[tuple[str, bool]]]) -> None:
        """Export each model's readiness (as ``/ready?model=`` answers it); ``models`` yields (model, ready)."""
        self.registry.register(_ModelCollector(models))


def _asyncio_tasks() -> float:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # scraped outside the serving loop
        return math.nan


class _GpuCollector(Collector):
    """GPU memory in use, for load testers comparing servers' memory against their load (the family is always
    declared; a machine without GPUs has no samples)."""

    def __init__(self, gpus: Callable[[], list[tuple[str, int]]]) -> None:
        self.gpus = gpus

    def collect(self):
        used = GaugeMetricFamily("burstgate:gpu_memory_used_bytes", "GPU memory in use, the whole device's (as "
                                 "nvidia-smi shows it), by GPU index.", labels=["gpu", "name"])
        for index, (name, used_bytes) in enumerate(self.gpus()):
            used.add_metric([str(index), name], float(used_bytes))
        yield used


class _ModelCollector(Collector):
    def __init__(self, models: Callable[[], Iterable[tuple[str, bool]]]) -> None:
        self.models = models

    def collect(self):
        ready = GaugeMetricFamily("burstgate:model_ready", "1 when a deployment of the model, or of one of its "
                                  "fallbacks, passed its last health check.", labels=["model"])
        for model, ok in self.models():
            ready.add_metric([model], 1.0 if ok else 0.0)
        yield ready


# An in-process engine's figures, under burstgate's names (labels model, backend) and vLLM's (labels model_name and
# engine, as vLLM's V1 engine exports them; engine: the deployment), so that routers and dashboards made for vLLM read a native deployment as they read vLLM:
# (EngineStats field, kind, name after the prefix, help)
ENGINE_FIGURES = [
    ("running", "gauge", "num_requests_running", "Sequences in the engine's batch."),
    ("waiting", "gauge", "num_requests_waiting", "Sequences queued in the engine."),
    ("kv_usage", "gauge", "kv_cache_usage_perc", "Fraction of KV blocks in use."),
    ("preemptions", "counter", "num_preemptions", "Sequences preempted."),
    ("prefix_cache_queries", "counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
]
# vLLM's only: burstgate:prompt_tokens_total and generation_tokens_total are the gateway's own, per request
VLLM_ONLY_FIGURES = [
    ("prompt_tokens", "counter", "prompt_tokens", "Prompt tokens computed (prefill)."),
    ("generation_tokens", "counter", "generation_tokens", "Tokens generated."),
]


class _EngineCollector(Collector):
    def __init__(self, engines: Callable[[], Iterable[tuple[str, str, EngineStats]]]) -> None:
        self.engines = engines

    def collect(self):
        families = {}
        for figures, ours_too in ((ENGINE_FIGURES, True), (VLLM_ONLY_FIGURES, False)):
            for field, kind, name, help_text in figures:
                family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                ours = family(f"burstgate:{name}", help_text, labels=["model", "backend"]) if ours_too else None
                families[field] = (ours, family(f"vllm:{name}", help_text, labels=["model_name", "engine"]))
        hit_rate = GaugeMetricFamily("burstgate:prefix_cache_hit_rate",
                                     "Prompt tokens served from the prefix cache / looked up.", labels=["model", "backend"])
        for model, backend, s in self.engines():
            for field, (ours, vllms) in families.items():
                value = getattr(s, field)
                if ours is not None:
                    ours.add_metric([model, backend], value)
                vllms.add_metric([model, backend], value)
            hit_rate.add_metric([model, backend], s.prefix_cache_hits / s.prefix_cache_queries
                                if s.prefix_cache_queries else 0.0)
        for pair in families.values():
            yield from (family for family in pair if family is not None)
        yield hit_rate
