"""When to send: arrival offsets (seconds from the run's start), all computed before the first send.

Precomputing avoids the drift of sleeping after each send (vLLM's old benchmark_serving did that).
``burst`` sends everything at t=0; ``poisson``/``gamma`` draw gaps from Gamma(burstiness, 1/(rate·b))
as vLLM does (burstiness 1 is Poisson, < 1 burstier, > 1 more even); ``constant`` spaces them evenly.
Fixed concurrency (closed loop) is not an arrival schedule: the runner enforces it with a semaphore.
"""

from __future__ import annotations

from enum import Enum

import numpy as np


class Schedule(str, Enum):
    burst = "burst"
    poisson = "poisson"
    gamma = "gamma"
    constant = "constant"


def arrival_offsets(schedule: Schedule, n: int, rate: float | None = None, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """``n`` send offsets in seconds, non-decreasing, starting at 0."""
    if n < 0:
        raise ValueError("the number of requests must be non-negative")
    if schedule is Schedule.burst:
        return [0.0] * n
    if rate is None or not rate > 0:
        raise ValueError(f"the {schedule.value} schedule needs a positive --rate (requests/s)")
    if schedule is Schedule.constant:
        return [i / rate for i in range(n)]
    shape = 1.0 if schedule is Schedule.poisson else burstiness
    if not shape > 0:
        raise ValueError("burstiness must be positive")
    gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()
