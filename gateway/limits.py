"""Admission limits: per-key requests/tokens per minute, and per-deployment concurrency with a queue.

Rate counters are fixed one-minute windows, kept in memory for one replica or in Redis (``INCRBY`` +
``EXPIRE`` in one pipeline) when replicas must share them. Tokens are charged after a request
finishes; a key whose window is already spent is refused before any work starts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from backends.base import OverloadedError
from gateway.errors import rate_limited

WINDOW_S = 60
log = logging.getLogger(__name__)


@dataclass
class KeyLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


class RateLimiter:
    """Fixed-window counters in process memory."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    async def _incr(self, key: str, amount: int) -> int:
        window_key = f"{key}:{int(time.time() // WINDOW_S)}"
        if len(self._counts) > 10_000:  # forget windows that have passed
            current = int(time.time() // WINDOW_S)
            self._counts = {k: v for k, v in self._counts.items() if int(k.rsplit(":", 1)[1]) >= current}
        self._counts[window_key] = self._counts.get(window_key, 0) + amount
        return self._counts[window_key]

    async def close(self) -> None:
        pass

    async def admit(self, key_name: str, limits: KeyLimits) -> None:
        """Count one request for the key; raise a 429 ``GatewayError`` if a limit is spent."""
        if limits.tokens_per_minute is not None:
            spent = await self._incr(f"tok:{key_name}", 0)
            if spent >= limits.tokens_per_minute:
                raise rate_limited(f"Token limit of {limits.tokens_per_minute}/min reached for key "
                                   f"'{key_name}'.", _seconds_to_next_window())
        if limits.requests_per_minute is not None:
            count = await self._incr(f"req:{key_name}", 1)
            if count > limits.requests_per_minute:
                raise rate_limited(f"Request limit of {limits.requests_per_minute}/min reached for key "
                                   f"'{key_name}'.", _seconds_to_next_window())

    async def charge_tokens(self, key_name: str, limits: KeyLimits, tokens: int) -> None:
        if limits.tokens_per_minute is not None and tokens > 0:
            await self._incr(f"tok:{key_name}", tokens)


class RedisRateLimiter(RateLimiter):
    """The same windows in Redis, shared by every gateway replica pointing at it.

    When Redis cannot be reached the limits stay enforced, per replica, in this process's memory
    (neither failing open nor refusing every request); ``redis_down`` says so for metrics and logs.
    """

    def __init__(self, url: str, timeout_s: float = 0.5) -> None:
        super().__init__()
        import redis.asyncio as redis

        self._redis = redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self.redis_down = False

    async def _incr(self, key: str, amount: int) -> int:
        window_key = f"burstgate:{key}:{int(time.time() // WINDOW_S)}"
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.incrby(window_key, amount)
                pipe.expire(window_key, WINDOW_S * 2)
                count, _ = await pipe.execute()
        except self._errors as exc:
            if not self.redis_down:
                log.error("Redis unreachable (%s): rate limits now counted per replica until it returns", exc)
            self.redis_down = True
            return await super()._incr(key, amount)
        if self.redis_down:
            log.warning("Redis is back: rate limits shared across replicas again")
            self.redis_down = False
        return int(count)

    async def close(self) -> None:
        await self._redis.aclose()


def _seconds_to_next_window() -> float:
    return WINDOW_S - time.time() % WINDOW_S


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
