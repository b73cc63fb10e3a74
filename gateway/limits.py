"""Admission limits: per-key requests/tokens per window, and per-deployment concurrency with a queue.

Rate counters are fixed windows (``limits.window_s``, a minute by default), kept in memory for one replica or
in Redis when replicas must share them (``INCRBY`` + ``EXPIRE`` in one transaction: every replica's increment is
atomic, so the requests admitted per window are exactly the limit whatever the replicas' number).

Tokens are budgeted as OpenAI counts them at admission: a request reserves its estimated prompt tokens plus the
output it may generate (``max_tokens`` x ``n``) in its window, and is refused when that would pass the budget
(the reservation is taken first and given back if it does not fit, so two replicas never both take the last
tokens). When it ends (completed, cancelled or failed) the reservation is settled to the tokens it really used,
in the window that admitted it: each token is charged once.

When Redis cannot be reached each replica goes on counting alone, from the last count Redis gave it for the
window (so an outage mid-window does not start the count again), until Redis answers again; the replicas then
share exact counts again from the next window.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from backends.base import GenerationRequest, OverloadedError
from gateway.errors import rate_limited

log = logging.getLogger(__name__)


@dataclass
class KeyLimits:
    requests_per_minute: int | None = None  # per window (the name says minute: the default window)
    tokens_per_minute: int | None = None


def estimated_tokens(request: GenerationRequest) -> int:
    """What ``request`` may cost, counted before it runs, as OpenAI's rate limiter counts it: its prompt (token ids
    as given; text at 4 characters a token) plus the output it may generate (``max_tokens`` x ``n``; a request
    without ``max_tokens`` reserves no output and is charged for it when it ends)."""
    if isinstance(request.prompt, list):
        prompt = len(request.prompt)
    elif request.prompt is not None:
        prompt = math.ceil(len(request.prompt) / 4)
    else:
        prompt = sum(4 + math.ceil(len(str(m.get("content") or "")) / 4) for m in request.messages or ())
    return prompt + (request.params.max_tokens or 0) * request.params.n


class RateLimiter:
    """Fixed-window counters in process memory."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._counts: dict[str, int] = {}

    def window(self) -> int:
        """The number of the window now."""
        return int(time.time() // self.window_s)

    async def _incr(self, key: str, amount: int, window: int) -> int:
        return self._local_incr(f"{key}:{window}", amount)

    def _local_incr(self, window_key: str, amount: int) -> int:
        return self._remember(window_key, self._counts.get(window_key, 0) + amount)

    def _remember(self, window_key: str, count: int) -> int:
        if len(self._counts) > 10_000:  # forget windows that have passed
            current = self.window()
            self._counts = {k: v for k, v in self._counts.items() if int(k.rsplit(":", 1)[1]) >= current - 1}
        self._counts[window_key] = count
        return count

    async def close(self) -> None:
        pass

    async def admit(self, key_name: str, limits: KeyLimits, reserve_tokens: int = 0) -> int:
        """Count one request for the key and reserve ``reserve_tokens`` of its token budget; raise a 429
        ``GatewayError`` if either limit would be passed. Returns the window the request was admitted in (where
        ``settle`` charges it)."""
        window = self.window()
        budget = limits.tokens_per_minute
        reserved = reserve_tokens if budget is not None else 0
        if budget is not None:
            if reserved > budget:
                raise rate_limited(f"Request too large for key '{key_name}': it may use {reserved} tokens, more than "
                                   f"its limit of {budget} {self._per()}. Lower max_tokens.", self._to_next_window())
            spent = await self._incr(f"tok:{key_name}", reserved, window)
            over = spent > budget if reserved else spent >= budget  # (nothing reserved: refused once it is spent)
            if over:
                if reserved:
                    await self._incr(f"tok:{key_name}", -reserved, window)  # given back: it did not fit
                raise rate_limited(f"Token limit of {budget} {self._per()} reached for key '{key_name}'.",
                                   self._to_next_window())
        if limits.requests_per_minute is not None:
            count = await self._incr(f"req:{key_name}", 1, window)
            if count > limits.requests_per_minute:
                if reserved:
                    await self._incr(f"tok:{key_name}", -reserved, window)
                raise rate_limited(f"Request limit of {limits.requests_per_minute} {self._per()} reached for key "
                                   f"'{key_name}'.", self._to_next_window())
        return window

    async def settle(self, key_name: str, limits: KeyLimits, window: int, reserved: int, used: int) -> None:
        """A request admitted in ``window`` with ``reserved`` tokens ended having used ``used``: what it did not use
        goes back to that window; what it used beyond its reservation (no max_tokens, a prompt longer than
        estimated) is charged to the window now, where the budget still counts."""
        if limits.tokens_per_minute is None or used == reserved:
            return
        await self._incr(f"tok:{key_name}", used - reserved, window if used < reserved else self.window())

    def _per(self) -> str:
        return "per minute" if self.window_s == 60 else f"per {self.window_s:g} s"

    def _to_next_window(self) -> float:
        return self.window_s - time.time() % self.window_s


class RedisRateLimiter(RateLimiter):
    """The same windows in Redis, shared by every gateway replica pointing at it.

    When Redis cannot be reached the limits stay enforced, per replica, in this process's memory, from the last
    count Redis returned for the window (neither failing open nor refusing every request); ``redis_down`` says
    so for metrics and logs.
    """

    def __init__(self, url: str, window_s: float = 60.0, timeout_s: float = 0.5) -> None:
        super().__init__(window_s)
        import redis.asyncio as redis

        self._redis = redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self.redis_down = False

    async def _incr(self, key: str, amount: int, window: int) -> int:
        window_key = f"burstgate:{key}:{window}"
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.incrby(window_key, amount)
                pipe.expire(window_key, math.ceil(self.window_s * 2))
                count, _ = await pipe.execute()
        except self._errors as exc:
            if not self.redis_down:
                log.error("Redis unreachable (%s): rate limits now counted per replica until it returns", exc)
            self.redis_down = True
            return self._local_incr(window_key, amount)
        if self.redis_down:
            log.warning("Redis is back: rate limits shared across replicas again")
            self.redis_down = False
        return self._remember(window_key, int(count))  # where this replica goes on from, should Redis go

    async def close(self) -> None:
        await self._redis.aclose()


class ConcurrencyLimiter:
    """At most ``max_concurrency`` requests in flight; up to ``max_queue`` more wait; beyond that, 429."""

    def __init__(self, max_concurrency: int, max_queue: int) -> None:
        self._slots = asyncio.Semaphore(max_concurrency)
        self.max_queue = max_queue
        self.waiting = 0
        self.in_flight = 0

    async def __aenter__(self) -> ConcurrencyLimiter:
        if self._slots.locked() and self.waiting >= self.max_queue:
            raise OverloadedError("The backend's queue is full; retry shortly.", retry_after=1.0)
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.in_flight += 1
        return self

    async def __aexit__(self, *exc) -> None:
        self.in_flight -= 1
        self._slots.release()
