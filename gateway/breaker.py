"""Per-deployment circuit breaker: stop sending traffic to a backend that keeps failing.

Closed: requests flow; ``failure_threshold`` consecutive failures open it. Open: no requests until
``cooldown_s`` has passed. Half-open: exactly one probe request goes through; its success closes the
breaker, its failure opens it for another cooldown. A probe that ends neither way (the client left)
frees the probe slot for the next request.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.IntEnum):
    """Values as exported in ``burstgate:breaker_state`` (0 closed, 1 half-open, 2 open)."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 5, cooldown_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[BreakerState], None] | None = None) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.on_change = on_change
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0
        self._probe_in_flight = False

    def available(self) -> bool:
        """Whether a request may be sent now (pure: choosing a deployment does not consume the probe)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return self.clock() - self.opened_at >= self.cooldown_s
        return not self._probe_in_flight

    def dispatch(self) -> None:
        """A request is being sent; after the cooldown the first one becomes the half-open probe."""
        if self.state is BreakerState.OPEN and self.available():
            self._set(BreakerState.HALF_OPEN)
        if self.state is BreakerState.HALF_OPEN:
            self._probe_in_flight = True

    def success(self) -> None:
        self.consecutive_failures = 0
        self._probe_in_flight = False
        if self.state is not BreakerState.CLOSED:
            self._set(BreakerState.CLOSED)

    def failure(self) -> None:
        self.consecutive_failures += 1
        self._probe_in_flight = False
        if self.state is BreakerState.HALF_OPEN or (
                self.state is BreakerState.CLOSED and self.consecutive_failures >= self.failure_threshold):
            self.opened_at = self.clock()
            self._set(BreakerState.OPEN)

    def release(self) -> None:
        """The request ended without telling us anything about the backend (e.g. the client left)."""
        self._probe_in_flight = False

    def _set(self, state: BreakerState) -> None:
        self.state = state
        if self.on_change is not None:
            self.on_change(state)
