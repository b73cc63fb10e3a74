"""Public model names → groups of deployments, and the choice of deployment for each request."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

from backends.base import Backend, UnavailableError
from gateway.limits import ConcurrencyLimiter

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Deployment:
    """One backend behind a model name, with its admission limiter and health."""

    name: str
    backend: Backend
    weight: float = 1.0
    limiter: ConcurrencyLimiter = field(default_factory=lambda: ConcurrencyLimiter(256, 1024))
    healthy: bool = True

    @property
    def outstanding(self) -> int:
        return self.limiter.in_flight + self.limiter.waiting


@dataclass
class ModelGroup:
    """The deployments serving one public model name. Choice: least outstanding requests per weight."""

    name: str
    deployments: list[Deployment]

    def choose(self) -> Deployment:
        candidates = [d for d in self.deployments if d.healthy]
        if not candidates:
            raise UnavailableError(f"no healthy backend for model '{self.name}'")
        best = min(d.outstanding / d.weight for d in candidates)
        return random.choice([d for d in candidates if d.outstanding / d.weight == best])

    @property
    def ready(self) -> bool:
        return any(d.healthy for d in self.deployments)


class HealthChecker:
    """Polls every deployment's ``health()`` in the background and marks it up or down."""

    def __init__(self, groups: list[ModelGroup], interval_s: float = 5.0, on_change=None) -> None:
        self.groups = groups
        self.interval_s = interval_s
        self.on_change = on_change
        self._task: asyncio.Task | None = None

    async def check_once(self) -> None:
        deployments = {d for g in self.groups for d in g.deployments}
        results = await asyncio.gather(*(self._check(d) for d in deployments))
        for d, ok in zip(deployments, results):
            if ok != d.healthy:
                log.warning("backend %s is now %s", d.name, "healthy" if ok else "UNHEALTHY")
            d.healthy = ok
            if self.on_change:
                self.on_change(d)

    @staticmethod
    async def _check(d: Deployment) -> bool:
        try:
            return bool(await asyncio.wait_for(d.backend.health(), timeout=5.0))
        except Exception:
            return False

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_once()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
