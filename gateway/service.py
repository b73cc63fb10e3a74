"""The gateway's request path independent of HTTP: choose a deployment, hold its slot, record metrics."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from backends.base import Backend, BackendError, GenerationChunk, GenerationRequest
from gateway.config import Settings
from gateway.deployments import build_backend
from gateway.errors import GatewayError, model_not_found
from gateway.limits import ConcurrencyLimiter, KeyLimits, RateLimiter, RedisRateLimiter
from gateway.metrics import GatewayMetrics
from gateway.routing import Deployment, HealthChecker, ModelGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """Who is asking: the API key's name (or 'anonymous') and its limits."""

    name: str
    limits: KeyLimits


ANONYMOUS = Caller("anonymous", KeyLimits())


class Gateway:
    def __init__(self, settings: Settings, groups: list[ModelGroup], rate_limiter: RateLimiter | None = None,
                 health_interval_s: float = 5.0) -> None:
        self.settings = settings
        self.groups = {g.name: g for g in groups}
        self.metrics = GatewayMetrics()
        self.rate_limiter = rate_limiter or (RedisRateLimiter(settings.limits.redis_url)
                                             if settings.limits.redis_url else RateLimiter())
        self.health = HealthChecker(groups, health_interval_s, on_change=self._export_health)
        self.metrics.watch_engines(self._engine_stats)

    @classmethod
    def from_settings(cls, settings: Settings) -> Gateway:
        """Deployments built (not started) from the configuration."""
        groups = []
        for route in settings.routes():
            deployments = []
            for i, cfg in enumerate(route.deployments):
                backend = build_backend(route.name, cfg)
                deployments.append(Deployment(cfg.name or f"{route.name}/{cfg.kind}-{i}", backend, cfg.weight,
                                              ConcurrencyLimiter(cfg.max_concurrency, cfg.max_queue)))
            groups.append(ModelGroup(route.name, deployments))
        return cls(settings, groups)

    # -------------------------------------------------------------------------------- lifecycle
    @property
    def backends(self) -> list[Backend]:
        return list({id(d.backend): d.backend for g in self.groups.values() for d in g.deployments}.values())

    async def start(self) -> None:
        for backend in self.backends:
            log.info("starting backend %s", backend.name)
            await backend.start()
        await self.health.check_once()
        self.health.start()
        for group in self.groups.values():
            for d in group.deployments:
                log.info("model %-28s -> %-32s %s", group.name, d.name, "up" if d.healthy else "DOWN")

    async def close(self) -> None:
        await self.health.stop()
        for backend in self.backends:
            await backend.close()
        await self.rate_limiter.close()

    def _export_health(self, d: Deployment) -> None:
        self.metrics.backend_healthy.labels(d.name).set(1 if d.healthy else 0)

    def _engine_stats(self):
        for group in self.groups.values():
            for d in group.deployments:
                stats = d.backend.stats()
                if stats is not None:
                    yield group.name, d.name, stats

    # ---------------------------------------------------------------------------------- serving
    async def admit(self, caller: Caller) -> None:
        """Count the request against the caller's limits; a spent limit raises a 429."""
        try:
            await self.rate_limiter.admit(caller.name, caller.limits)
        except GatewayError:
            self.metrics.rate_limited.labels(caller.name).inc()
            raise

    def group(self, model: str) -> ModelGroup:
        group = self.groups.get(model)
        if group is None:
            raise model_not_found(model)
        return group

    async def generate(self, group: ModelGroup, request: GenerationRequest, caller: Caller
                       ) -> AsyncIterator[GenerationChunk]:
        """Stream one request from a chosen deployment. Errors before the first chunk propagate as raised;
        closing the iterator aborts the backend's work."""
        deployment = group.choose()
        labels = (group.name, deployment.name)
        m = self.metrics
        start = last = time.perf_counter()
        status, first, usage = "error", True, None
        async with deployment.limiter:
            m.in_flight.labels(*labels).inc()
            try:
                async with contextlib.aclosing(deployment.backend.stream(request)) as chunks:
                    async for chunk in chunks:
                        now = time.perf_counter()
                        (m.ttft if first else m.itl).labels(*labels).observe(now - last)
                        first, last = False, now
                        if chunk.usage is not None:
                            usage = chunk.usage
                        yield chunk
                status = "ok"
            except BackendError as exc:
                status = exc.kind
                raise
            except BaseException:  # GeneratorExit / CancelledError: the client left
                status = "cancelled"
                raise
            finally:
                m.in_flight.labels(*labels).dec()
                m.requests.labels(*labels, status).inc()
                m.e2e.labels(*labels).observe(time.perf_counter() - start)
                if usage is not None:
                    m.prompt_tokens.labels(*labels).inc(usage.prompt_tokens)
                    m.generation_tokens.labels(*labels).inc(usage.completion_tokens)
                    await self.rate_limiter.charge_tokens(caller.name, caller.limits, usage.total_tokens)
