"""Active health checks: every deployment's ``health()`` polled in the background.

Passive marking is the circuit breaker's job (gateway/breaker.py): a deployment that fails requests
stops receiving them before the next poll notices.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.deployments import Deployment
from gateway.routing import ModelGroup

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, groups: list[ModelGroup], interval_s: float = 5.0, timeout_s: float = 5.0,
                 on_change: Callable[[Deployment], None] | None = None) -> None:
        """``on_change`` hears every deployment after each check (its health may or may not have changed); a
        deployment that turns unhealthy is forgotten by its groups' routing policies (its cache may be gone)."""
        self.groups = groups
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_change = on_change
        self._task: asyncio.Task | None = None

    @property
    def deployments(self) -> list[Deployment]:
        """Every deployment of the groups now (discovered replicas come and go), each once."""
        return list({id(d): d for g in self.groups for d in g.deployments}.values())

    async def check_once(self) -> None:
        deployments = self.deployments
        results = await asyncio.gather(*(self.check(d) for d in deployments))
        present = {id(d) for d in self.deployments}  # a replica that left while it was checked is not reported
        for d, ok in zip(deployments, results):
            if id(d) not in present:
                continue
            if ok != d.healthy:
                log.warning("backend %s is now %s", d.name, "healthy" if ok else "UNHEALTHY")
                if not ok:
                    for group in self.groups:
                        if d in group.deployments:
                            group.policy.forget(d)
            d.healthy = ok
            if self.on_change:
                self.on_change(d)

    async def check(self, d: Deployment) -> bool:
        """Whether ``d`` answers its health check in time."""
        try:
            return bool(await asyncio.wait_for(d.backend.health(), timeout=self.timeout_s))
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
