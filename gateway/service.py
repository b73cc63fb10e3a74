"""The gateway's request path independent of HTTP: choose a deployment, hold its slot, record metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from backends.base import (
    TRACEPARENT,
    Backend,
    BackendError,
    BackendTimeoutError,
    GenerationChunk,
    GenerationRequest,
    UnavailableError,
    UsageTally,
)
from gateway.breaker import BreakerState, CircuitBreaker
from gateway.config import DeploymentConfig, Resilience, Settings
from gateway.deployments import Deployment, build_backend
from gateway.discovery.membership import Membership
from gateway.drain import Drain
from gateway.errors import GatewayError, model_not_found
from gateway.health import HealthChecker
from gateway.limits import ConcurrencyLimiter, KeyLimits, RateLimiter, RedisRateLimiter, estimated_tokens
from gateway.metrics import GatewayMetrics
from gateway.routing import Choice, Conversation, ModelGroup
from gateway.tracing import Tracing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """Who is asking: the API key's name (or 'anonymous') and its limits; once admitted, the rate window that
    admitted the request (where its tokens are charged)."""

    name: str
    limits: KeyLimits
    window: int | None = None


ANONYMOUS = Caller("anonymous", KeyLimits())


RETRYABLE = frozenset({"unavailable", "overloaded", "timeout", "upstream_error"})
BREAKER_FAILURES = frozenset({"unavailable", "timeout", "upstream_error"})  # overload is not ill health


class Gateway:
    def __init__(self, settings: Settings, groups: list[ModelGroup], rate_limiter: RateLimiter | None = None) -> None:
        self.settings = settings
        self.resilience = settings.resilience
        self.groups = {g.name: g for g in groups}
        self.metrics = GatewayMetrics()
        self.drain = Drain(settings.server.drain_grace_s, settings.server.drain_timeout_s)
        self.tracing = Tracing.from_config(settings.tracing)  # None when off: one check per span
        limits = settings.limits
        self.rate_limiter = rate_limiter or (RedisRateLimiter(limits.redis_url, limits.window_s)
                                             if limits.redis_url else RateLimiter(limits.window_s))
        self.health = HealthChecker(groups, self.resilience.health_interval_s, self.resilience.health_timeout_s,
                                    on_change=self._export_health)
        self.metrics.watch_engines(self._engine_stats)
        self.metrics.watch_models(lambda: ((name, self.can_serve(g)) for name, g in self.groups.items()))
        self._background: list[asyncio.Task] = []  # the routing policies' own work (scrapers, event readers)
        self.memberships: list[Membership] = []  # discovered deployments (from_settings)
        self._replica_jobs: dict[Deployment, list[asyncio.Task]] = {}  # a discovered replica's policy jobs
        self._retiring: set[asyncio.Task] = set()  # replicas gone, finishing what they run
        self._settling: set[asyncio.Task] = set()  # token charges of requests that ended
        for d in self.health.deployments:
            d.breaker.on_change = self._breaker_exporter(d)

    @classmethod
    def from_settings(cls, settings: Settings) -> Gateway:
        """Deployments built (not started) from the configuration; a deployment with ``discover:`` is a template
        whose replicas are found when the gateway starts (gateway/discovery/)."""
        groups, templates = [], []
        for route in settings.routes():
            deployments = []
            for i, cfg in enumerate(route.deployments):
                name = cfg.name or f"{route.name}/{cfg.kind}-{i}"
                if cfg.discover is not None:
                    templates.append((route.name, cfg, name))
                else:
                    deployments.append(build_deployment(route.name, cfg, name, settings.resilience))
            groups.append(ModelGroup(route.name, deployments, routing=route.routing, fallbacks=route.fallbacks))
        gateway = cls(settings, groups)
        gateway.memberships = [Membership(gateway.groups[model], cfg, name, gateway._join, gateway._leave)
                               for model, cfg, name in templates]
        return gateway

    # -------------------------------------------------------------------------------- lifecycle
    @property
    def backends(self) -> list[Backend]:
        return list({id(d.backend): d.backend for g in self.groups.values() for d in g.deployments}.values())

    async def start(self) -> None:
        for backend in self.backends:
            log.info("starting backend %s", backend.name)
            await backend.start()
        # the policies' jobs for the deployments listed; a discovered replica gets its own when it joins
        jobs = [(g, job) for g in self.groups.values() for job in g.policy.background()]
        for membership in self.memberships:  # the replicas there are now, before readiness is first told
            await membership.refresh()
        await self.health.check_once()
        self.health.start()
        for group in self.groups.values():
            await group.prepare()
        self._background = [asyncio.create_task(job(), name=f"routing {g.name}") for g, job in jobs]
        self._background += [asyncio.create_task(m.run(), name=f"discovery {m.name}") for m in self.memberships]
        for group in self.groups.values():
            for d in group.deployments:
                log.info("model %-28s -> %-32s %s", group.name, d.name, "up" if d.healthy else "DOWN")

    async def close(self) -> None:
        tasks = [*self._background, *self._retiring, *(t for jobs in self._replica_jobs.values() for t in jobs)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.health.stop()
        for backend in self.backends:
            await backend.close()
        await asyncio.gather(*self._settling, return_exceptions=True)
        await self.rate_limiter.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.close)  # exports what is buffered

    async def _join(self, group: ModelGroup, cfg: DeploymentConfig) -> Deployment:
        """A discovered replica: built, started, checked once, then routed to."""
        assert cfg.name is not None  # discovery names each replica (Membership.replica)
        d = build_deployment(group.name, cfg, cfg.name, self.resilience)
        await d.backend.start()
        d.healthy = await self.health.check(d)
        d.breaker.on_change = self._breaker_exporter(d)
        self._export_health(d)
        self._replica_jobs[d] = [asyncio.create_task(job(), name=f"routing {d.name}") for job in group.join(d)]
        log.info("model %-28s -> %-32s joined (%s)", group.name, d.name, "up" if d.healthy else "DOWN")
        return d

    def _leave(self, group: ModelGroup, d: Deployment) -> None:
        """A replica gone: no new request goes to it; it is closed once what it runs is done."""
        group.leave(d)
        for task in self._replica_jobs.pop(d, []):
            task.cancel()
        log.info("model %-28s -> %-32s left (%d request(s) to finish)", group.name, d.name, d.outstanding)
        task = asyncio.create_task(self._retire(group.name, d), name=f"retire {d.name}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, model: str, d: Deployment) -> None:
        try:
            while d.outstanding:
                await asyncio.sleep(0.1)
        finally:
            self.groups[model].policy.forget(d)  # what its last requests recorded in the routing index
            await d.backend.close()
            if not any(other.name == d.name for other in self.groups[model].deployments):  # not back meanwhile
                self.metrics.forget_deployment(model, d.name)

    def _export_health(self, d: Deployment) -> None:
        self.metrics.backend_healthy.labels(d.name).set(1 if d.healthy else 0)

    def _breaker_exporter(self, d: Deployment):
        def export(state: BreakerState) -> None:
            log.warning("backend %s: circuit breaker %s", d.name, state.name.lower())
            self.metrics.breaker_state.labels(d.name).set(state)
        self.metrics.breaker_state.labels(d.name).set(d.breaker.state)
        return export

    def _engine_stats(self):
        for group in self.groups.values():
            for d in group.deployments:
                stats = d.backend.stats()
                if stats is not None:
                    yield group.name, d.name, stats

    # ---------------------------------------------------------------------------------- serving
    async def admit(self, caller: Caller, requests: list[GenerationRequest]) -> Caller:
        """Count the request (its generation ``requests``) against the caller's limits, reserving the tokens they
        may use; a spent limit raises a 429. Returns the caller as admitted: ``generate`` charges it."""
        span = self.tracing.start("admit", {"burstgate.key": caller.name}) if self.tracing else None
        reserve = sum(map(estimated_tokens, requests)) if caller.limits.tokens_per_minute is not None else 0
        try:
            window = await self.rate_limiter.admit(caller.name, caller.limits, reserve)
            return dataclasses.replace(caller, window=window)
        except GatewayError as exc:
            self.metrics.rate_limited.labels(caller.name).inc()
            if span is not None and self.tracing is not None:
                self.tracing.failed(span, "rate_limited", exc.message)
            raise
        finally:
            if span is not None:
                span.end()

    def can_serve(self, group: ModelGroup) -> bool:
        """A deployment of ``group``, or of one of its fallbacks, passed its last health check."""
        return group.ready or any(self.groups[name].ready for name in group.fallbacks)

    def group(self, model: str) -> ModelGroup:
        group = self.groups.get(model)
        if group is None:
            raise model_not_found(model)
        return group

    async def generate(self, group: ModelGroup, request: GenerationRequest, caller: Caller,
                       conversation: Conversation | None = None) -> AsyncGenerator[GenerationChunk, None]:
        """Stream one request. Failures before the first chunk are retried on other deployments (with
        backoff), then on the fallback models; the last error propagates as raised. After the first
        chunk a failure ends the stream. Closing the iterator aborts the backend's work. A request of a
        ``conversation`` is routed to where the conversation is held, and says where it was served. When it ends,
        however it ends, the caller's token budget is charged what its attempts used, against what ``admit``
        reserved for it."""
        used: list[int] = []  # tokens per attempt
        try:
            attempt = 0
            last_error: BackendError | None = None
            failed: tuple[str, str] | None = None
            for g in [group, *(self.groups[name] for name in group.fallbacks)]:
                if g is not group:
                    self.metrics.fallbacks.labels(group.name, g.name).inc()
                    log.warning("model %s: falling back to %s after %s", group.name, g.name, last_error)
                tried: list[Deployment] = []
                for _ in range(self.resilience.retries + 1):
                    if attempt:
                        r = self.resilience
                        await asyncio.sleep(random.uniform(0, min(r.retry_backoff_max_s,
                                                                  r.retry_backoff_s * 2 ** (attempt - 1))))
                    choice = await _choose(g, request, tried, conversation if g is group else None)
                    if choice is None:
                        last_error = last_error or UnavailableError(f"no healthy backend for model '{g.name}'")
                        break
                    deployment = choice.deployment
                    self._dispatched(g, choice, conversation, attempt + 1)
                    if failed is not None and last_error is not None:
                        self.metrics.retries.labels(*failed, last_error.kind).inc()
                    attempt += 1
                    tried.append(deployment)
                    started = False
                    answer: list[str] = []  # the first choice's text, for the routing policy once it is done
                    try:
                        async with contextlib.aclosing(self._attempt(g, deployment, request, used)) as chunks:
                            async for chunk in chunks:
                                started = True
                                if chunk.index == 0 and chunk.text:
                                    answer.append(chunk.text)
                                yield chunk
                        if g.policy.needs_tokens:
                            await g.finished(choice, "".join(answer))
                        return
                    except BackendError as exc:
                        if started or exc.kind not in RETRYABLE:
                            raise
                        last_error, failed = exc, (g.name, deployment.name)
                        log.info("request %s: %s failed before its first token (%s)",
                                 request.request_id, deployment.name, exc.kind)
            raise last_error or UnavailableError(f"no healthy backend for model '{group.name}'")
        finally:
            self._settle(caller, request, used)

    def _dispatched(self, group: ModelGroup, choice: Choice, conversation: Conversation | None, attempt: int) -> None:
        """Attempt ``attempt`` goes where ``choice`` says: the conversation, metrics and trace hear of it, and the
        deployment's breaker counts it (right after choosing: only one half-open probe goes out)."""
        d = choice.deployment
        if conversation is not None:
            conversation.served_by = d.name
        self.metrics.routing_decisions.labels(group.name, d.name, choice.reason).inc()
        if self.tracing is not None:
            self.tracing.route(group.name, group.routing, choice, attempt)
        if (blocks := group.policy.index_blocks(d)) is not None:
            self.metrics.prefix_index_blocks.labels(group.name, d.name).set(blocks)
            self.metrics.prefix_index_precise.labels(group.name, d.name).set(bool(group.policy.index_precise(d)))
        if (load_cost := group.policy.load_cost_tokens()) is not None:
            self.metrics.routing_load_cost_tokens.labels(group.name).set(load_cost)
        d.breaker.dispatch()

    def _settle(self, caller: Caller, request: GenerationRequest, used: list[int]) -> None:
        """Charge ``caller``'s token budget what ``request``'s attempts ``used``, against its reservation: in a task of
        its own, since a request ended by its client's hang-up is being cancelled, and an await here would be
        cancelled too (anyio cancels every await of a cancelled scope), leaving it charged its reservation."""
        if caller.window is None or caller.limits.tokens_per_minute is None:
            return
        settle = asyncio.create_task(self.rate_limiter.settle(caller.name, caller.limits, caller.window,
                                                              estimated_tokens(request), sum(used)))
        self._settling.add(settle)
        settle.add_done_callback(self._settling.discard)

    async def _attempt(self, group: ModelGroup, deployment: Deployment, request: GenerationRequest,
                       used: list[int]) -> AsyncGenerator[GenerationChunk, None]:
        """One try on one deployment: its slot held, its deadlines enforced, its breaker and metrics fed; the
        tokens it used (also when it ends early) added to ``used``."""
        labels = (group.name, deployment.name)
        m = self.metrics
        start = last = time.perf_counter()
        status, first, tally = "error", True, UsageTally()  # counts tokens also when the request ends early
        span = self.tracing.upstream(group.name, deployment) if self.tracing else None
        traceparent = self.tracing.traceparent(span) if span is not None and self.tracing is not None else None
        try:
            async with deployment.limiter:
                m.in_flight.labels(*labels).inc()
                try:
                    loop = asyncio.get_running_loop()
                    total = loop.time() + deployment.total_timeout_s if deployment.total_timeout_s else None
                    async with contextlib.aclosing(deployment.backend.stream(request)) as chunks:
                        while True:
                            try:
                                chunk = await _next_within(chunks, _deadline(loop, first, deployment, total),
                                                           self.drain, traceparent if first else None)
                            except StopAsyncIteration:
                                break
                            now = time.perf_counter()
                            if first:
                                deployment.observe_ttft(now - start)
                                if span is not None:
                                    span.add_event("first_token")
                            (m.ttft if first else m.itl).labels(*labels).observe(now - last)
                            first, last = False, now
                            tally.add(chunk)
                            yield chunk
                finally:
                    m.in_flight.labels(*labels).dec()
            status = "ok"
            deployment.breaker.success()
        except BackendError as exc:
            status = exc.kind
            if exc.kind in BREAKER_FAILURES:
                deployment.breaker.failure()
            else:
                deployment.breaker.release()
            if span is not None and self.tracing is not None:
                self.tracing.failed(span, exc.kind, exc.message)
            raise
        except BaseException:  # GeneratorExit / CancelledError: the client left
            status = "cancelled"
            deployment.breaker.release()
            raise
        finally:
            m.requests.labels(*labels, status).inc()
            m.e2e.labels(*labels).observe(time.perf_counter() - start)
            usage = tally.total()  # a cancelled or failed request is charged what it generated
            if span is not None:
                span.set_attributes({"burstgate.status": status, "gen_ai.usage.input_tokens": usage.prompt_tokens,
                                     "gen_ai.usage.output_tokens": usage.completion_tokens})
                span.end()
            used.append(usage.total_tokens)
            if usage.total_tokens:
                m.prompt_tokens.labels(*labels).inc(usage.prompt_tokens)
                m.generation_tokens.labels(*labels).inc(usage.completion_tokens)


def build_deployment(model: str, cfg: DeploymentConfig, name: str, resilience: Resilience) -> Deployment:
    """The deployment ``cfg`` describes, under ``name``, its backend built (not started)."""
    return Deployment(name=name, backend=build_backend(model, cfg), weight=cfg.weight,
                      limiter=ConcurrencyLimiter(cfg.max_concurrency, cfg.max_queue),
                      breaker=CircuitBreaker(resilience.breaker_failures, resilience.breaker_cooldown_s),
                      first_token_timeout_s=cfg.first_token_timeout_s, total_timeout_s=cfg.total_timeout_s, config=cfg)


async def _choose(group: ModelGroup, request: GenerationRequest, tried: list[Deployment],
                  conversation: Conversation | None) -> Choice | None:
    """A deployment not tried yet, else any available one (a retry on the same backend beats none)."""
    for exclude in (tried, ()):
        try:
            return await group.route(request, exclude=exclude, conversation=conversation)
        except UnavailableError:
            if not tried:
                return None
    return None


def _deadline(loop: asyncio.AbstractEventLoop, first: bool, d: Deployment, total: float | None) -> float | None:
    """The loop time by which the next chunk must arrive: the first-token limit, then the total one."""
    if first and d.first_token_timeout_s:
        first_deadline = loop.time() + d.first_token_timeout_s
        return first_deadline if total is None else min(first_deadline, total)
    return total


async def _next_within(chunks: AsyncIterator[GenerationChunk], deadline: float | None, drain: Drain,
                       traceparent: str | None = None) -> GenerationChunk:
    """The next chunk by ``deadline``; an HTTP backend's call made meanwhile carries ``traceparent``."""
    token = TRACEPARENT.set(traceparent) if traceparent is not None else None
    try:
        if deadline is None:
            return await drain.next_chunk(anext(chunks))
        async with asyncio.timeout_at(deadline):
            return await drain.next_chunk(anext(chunks))
    except TimeoutError:
        raise BackendTimeoutError("the backend did not answer in time") from None
    finally:
        if token is not None:
            TRACEPARENT.reset(token)
