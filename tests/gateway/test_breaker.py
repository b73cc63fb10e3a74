"""The circuit breaker's state machine: closed → open after N failures → one half-open probe → closed/open."""

from __future__ import annotations

from gateway.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_only():
    b = CircuitBreaker(failure_threshold=3, cooldown_s=10, clock=Clock())
    b.failure(), b.failure(), b.success(), b.failure(), b.failure()
    assert b.state is BreakerState.CLOSED
    b.failure()
    assert b.state is BreakerState.OPEN and not b.available()


def test_one_probe_after_the_cooldown_and_its_outcome_decides():
    clock, changes = Clock(), []
    b = CircuitBreaker(failure_threshold=1, cooldown_s=10, clock=clock, on_change=changes.append)
    b.failure()
    clock.now = 9.9
    assert not b.available()
    clock.now = 10.0
    assert b.available()
    b.dispatch()
    assert b.state is BreakerState.HALF_OPEN and not b.available()  # the probe is out: nobody else
    b.failure()
    assert b.state is BreakerState.OPEN and not b.available()  # another full cooldown
    clock.now = 20.0
    b.dispatch()
    b.success()
    assert b.state is BreakerState.CLOSED and b.available()
    assert changes == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.OPEN, BreakerState.HALF_OPEN,
                       BreakerState.CLOSED]


def test_a_probe_that_tells_nothing_frees_the_slot():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, cooldown_s=1, clock=clock)
    b.failure()
    clock.now = 1.0
    b.dispatch()
    b.release()  # e.g. the client disconnected
    assert b.state is BreakerState.HALF_OPEN and b.available()
