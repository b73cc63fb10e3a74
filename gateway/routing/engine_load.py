"""How loaded each engine is, as it says itself: the requests it runs and queues and the share of its KV cache in
use, read at a fixed interval from its Prometheus ``/metrics`` (vLLM's names, ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, and burstgate's own, ``burstgate:...``), or from an
in-process engine directly. Every gateway replica reads the same engines, so they route on the same truth."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from gateway.deployments import Deployment

log = logging.getLogger(__name__)

# The families read, by what they mean; vLLM's older name for the KV usage is kept for its older servers.
NAMES = {"running": ("vllm:num_requests_running", "burstgate:num_requests_running"),
         "waiting": ("vllm:num_requests_waiting", "burstgate:num_requests_waiting"),
         "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "burstgate:kv_cache_usage_perc")}


@dataclass(frozen=True)
class EngineLoad:
    running: float
    waiting: float
    kv_usage: float  # 0..1
    at: float  # time.monotonic() of the reading


def parse_metrics(text: str) -> EngineLoad | None:
    """The load in a Prometheus text page: each figure summed over its series; None if it has none of them."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for what, names in NAMES.items():
            if family.name in names and what not in found:
                found[what] = sum(s.value for s in family.samples if s.name == family.name)
    if not found:
        return None
    return EngineLoad(found.get("running", 0.0), found.get("waiting", 0.0), found.get("kv_usage", 0.0),
                      time.monotonic())


def metrics_url(deployment: Deployment) -> str | None:
    """Where a remote deployment's engine serves /metrics: its server root (vLLM's, SGLang's, burstgate's)."""
    base = getattr(deployment.backend, "base_url", None)
    return None if base is None else base.removesuffix("/v1") + "/metrics"


def _tls(deployment: Deployment) -> ssl.SSLContext | bool:
    """The deployment's own TLS settings for its server (a private CA, a client certificate), else the defaults."""
    verify = getattr(deployment.config, "tls_verify", None)
    return verify() if verify else True


def _tls_name(deployment: Deployment) -> dict:
    """The name its server's certificate carries, where its URL names an address (a discovered replica)."""
    name = getattr(deployment.config, "tls_server_name", None)
    return {"extensions": {"sni_hostname": name}} if name else {}


class LoadReader:
    """The latest load of each deployment, refreshed every ``interval_s`` while ``run`` runs."""

    def __init__(self, deployments: list[Deployment], interval_s: float) -> None:
        self.deployments, self.interval_s = deployments, interval_s
        self.loads: dict[str, EngineLoad] = {}

    def load(self, deployment: Deployment) -> EngineLoad | None:
        """The deployment's load: an in-process engine's now, else the latest scraped (None once stale: three
        intervals without an answer)."""
        stats = deployment.backend.stats()
        if stats is not None:
            return EngineLoad(stats.running, stats.waiting, stats.kv_usage, time.monotonic())
        load = self.loads.get(deployment.name)
        if load is None or time.monotonic() - load.at > 3 * self.interval_s:
            return None
        return load

    def forget(self, deployment: Deployment) -> None:
        """A replica gone: its last load is no longer anyone's."""
        self.loads.pop(deployment.name, None)

    async def run(self) -> None:
        clients: dict[str, httpx.AsyncClient] = {}  # per deployment (its own TLS settings); replicas come and go
        try:
            while True:
                remote = [(d, url) for d in self.deployments if (url := metrics_url(d)) is not None]
                for name in clients.keys() - {d.name for d, _ in remote}:
                    await clients.pop(name).aclose()
                for d, _ in remote:
                    if d.name not in clients:
                        clients[d.name] = httpx.AsyncClient(timeout=self.interval_s, verify=_tls(d))
                await asyncio.gather(*(self._read(clients[d.name], d, url) for d, url in remote))
                await asyncio.sleep(self.interval_s)
        finally:
            for client in clients.values():
                await client.aclose()

    async def _read(self, http: httpx.AsyncClient, deployment: Deployment, url: str) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError):  # unreachable or not Prometheus: stale, then None
            load = parse_metrics((await http.get(url, **_tls_name(deployment))).text)
            if load is not None:
                self.loads[deployment.name] = load
