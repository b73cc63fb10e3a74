"""When to send: arrival offsets (seconds from the run's start), all computed before the first send.

Precomputing avoids the drift of sleeping after each send (vLLM's old benchmark_serving did that).
As ``vllm bench serve`` (vllm/benchmarks/serve.py ``get_request``): ``burst`` sends everything at t=0
(request rate inf); ``poisson`` and ``gamma`` add up gaps drawn from Gamma(burstiness, 1/(rate·b))
(burstiness 1 is Poisson, < 1 burstier, > 1 more even) and rescale the sum so the last request is due
at exactly n/rate, so every seed offers exactly the asked rate; ``constant`` is vLLM's burstiness inf:
gaps of exactly 1/rate, the first request one gap after the start. ``trace`` sends each request at the time
its trace recorded (loadtest/trace.py): the offsets come with the requests.
Fixed concurrency (closed loop) is not an arrival schedule: the runner enforces it with a semaphore.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np


class Schedule(StrEnum):
    burst = "burst"
    poisson = "poisson"
    gamma = "gamma"
    constant = "constant"
    trace = "trace"


def used_burstiness(schedule: Schedule, burstiness: float) -> float:
    """The gamma shape a schedule really uses (what vLLM's result JSON records as ``burstiness``)."""
    if schedule is Schedule.constant:
        return float("inf")
    return burstiness if schedule is Schedule.gamma else 1.0


def check(schedule: Schedule, rate: float | None, burstiness: float) -> None:
    """Refuses settings a schedule would not use (nothing accepted and ignored)."""
    if schedule is Schedule.trace:
        if rate is not None or burstiness != 1.0:
            raise ValueError("a trace's requests carry their own send times: drop --rate and --burstiness "
                             "(--time-scale stretches them)")
        return
    if schedule is Schedule.burst:
        if rate is not None:
            raise ValueError("a burst sends everything at t=0: --rate needs --schedule poisson, gamma or constant")
    elif rate is None or not rate > 0:
        raise ValueError(f"the {schedule.value} schedule needs a positive --rate (requests/s)")
    if schedule is not Schedule.gamma and burstiness != 1.0:
        raise ValueError(f"--burstiness shapes the gamma schedule only, not {schedule.value} "
                         "(poisson is gamma with burstiness 1)")
    if not burstiness > 0:
        raise ValueError("--burstiness must be positive")


def arrival_offsets(schedule: Schedule, n: int, rate: float | None = None, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """``n`` send offsets in seconds, non-decreasing; for a rate, the last is due at exactly n/rate."""
    if n < 0:
        raise ValueError("the number of requests must be non-negative")
    check(schedule, rate, burstiness)
    if schedule is Schedule.trace:
        raise ValueError("a trace's send times come with its requests, not from a schedule")
    if schedule is Schedule.burst or n == 0:
        return [0.0] * n
    assert rate is not None  # check() refused the other schedules without one
    if schedule is Schedule.constant:
        return [(i + 1) / rate for i in range(n)]
    shape = used_burstiness(schedule, burstiness)
    delays = np.cumsum(np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), size=n))
    return (delays * (n / rate) / delays[-1]).tolist()


def offered_rate(offsets: list[float]) -> float | None:
    """Requests per second the schedule offers: n over the time the last one is due (None for a burst)."""
    return len(offsets) / offsets[-1] if offsets and offsets[-1] > 0 else None
