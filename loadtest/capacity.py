"""Which rates a target carries: guidellm's ``sweep``, and the highest rate that still meets an SLO.

Both start as guidellm's sweep does: a **synchronous** point (one request at a time: the latency floor and the
lowest rate worth trying) and a **throughput** point (everything at once: the most requests per second the
target completes). The sweep then measures N constant rates spread evenly between the two
(``linspace(synchronous, throughput, N + 1)[1:]``, guidellm's SweepProfile).

The **capacity at an SLO** is the highest request rate whose goodput meets every ``--goodput`` SLO: a rate
passes when at least ``attainment`` of its requests (DistServe's SLO attainment; 90% by default) meet every SLO,
a failed request counting as a miss. The search brackets the answer between the synchronous rate (passing, or
the capacity is 0) and the throughput rate (failing, or the capacity is that rate: the target's limit, not the
SLO's), then bisects until the bracket is within ``precision`` of its top: the capacity is the highest passing
rate found, and the first failing one is at most ``precision`` above it. Each probe is one measurement with
fresh prompts, so a noisy target can make the curve non-monotonic: every probe is kept and reported.

Over multi-turn conversations the rate is of **conversations** arriving (each then sends its turns one after
another): one conversation at a time is the synchronous point, all at once the throughput point, and the rates
compared are conversations completed (every turn answered) per second; the SLOs hold per request, every turn.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from loadtest.metrics import meets_slos
from loadtest.runner import RunConfig, TargetResult
from loadtest.schedule import Schedule

Measure = Callable[[RunConfig, str], Awaitable[TargetResult]]  # one measurement at a point, with its role


@dataclass
class Capacity:
    """The answer of one search for one target, with every probe behind it."""

    slos_ms: dict[str, float]
    attainment: float
    precision: float
    rate: float  # in ``unit``; 0 when even one request (conversation) at a time misses the SLO
    limited_by: str  # "slo", "throughput" (the SLO holds up to the target's limit) or "latency floor"
    arrivals: str  # how each probe's requests arrive: constant, poisson, gamma burstiness=B
    probes: list[dict] = field(default_factory=list)  # {"role", "rate", "throughput", "attained", "passed", ...}
    unit: str = "requests/s"  # or "conversations/s" over multi-turn conversations

    def to_json(self) -> dict:
        return asdict(self)


def attained(result: TargetResult, slos_ms: dict[str, float]) -> float:
    """The share of the point's requests that were answered and met every SLO."""
    records = result.records
    return sum(r.ok and meets_slos(r, slos_ms) for r in records) / len(records) if records else 0.0


def rate_unit(result: TargetResult) -> str:
    """What a point's rates count: conversations (a multi-turn run) or requests per second."""
    return "conversations/s" if "conversation_throughput" in result.summary else "requests/s"


def completed_rate(result: TargetResult) -> float:
    """The point's throughput in its ``rate_unit``: conversations completed or requests answered per second."""
    s = result.summary
    return s["conversation_throughput"] if "conversation_throughput" in s else s["request_throughput"]


def synchronous(base: RunConfig) -> RunConfig:
    return replace(base, schedule=Schedule.burst, rate=None, concurrency=1)


def throughput(base: RunConfig) -> RunConfig:
    return replace(base, schedule=Schedule.burst, rate=None, concurrency=None)


def at_rate(base: RunConfig, rate: float) -> RunConfig:
    """A point at ``rate``: constant arrivals (guidellm's sweep), the base's poisson or gamma schedule, or its
    trace replayed with its times scaled to that mean rate."""
    kept = (Schedule.poisson, Schedule.gamma, Schedule.trace)
    schedule = base.schedule if base.schedule in kept else Schedule.constant
    return replace(base, schedule=schedule, rate=rate, concurrency=None)


def arrivals(base: RunConfig) -> str:
    """How the requests of ``at_rate(base, ...)`` arrive, in words."""
    cfg = at_rate(base, 1.0)
    if cfg.schedule is Schedule.trace:
        return "trace, time-scaled"
    return cfg.schedule.value + (f" burstiness={cfg.burstiness:g}" if cfg.schedule is Schedule.gamma else "")


def sweep_rates(sync_rate: float, max_rate: float, n: int) -> list[float]:
    """guidellm's sweep: ``n`` rates evenly between the synchronous and the throughput rate, the last at it."""
    return [float(r) for r in np.linspace(sync_rate, max_rate, n + 1)[1:]]


async def sweep(measure: Measure, base: RunConfig, n: int) -> list[TargetResult]:
    """Synchronous, throughput, then ``n`` constant rates between them (of conversations, over a multi-turn
    workload)."""
    floor = await measure(synchronous(base), "synchronous")
    top = await measure(throughput(base), "throughput")
    results = [floor, top]
    for rate in sweep_rates(completed_rate(floor), completed_rate(top), n):
        point = at_rate(base, rate)
        results.append(await measure(point, point.schedule.value))  # constant, or the base's arrivals
    return results


async def search(measure: Measure, base: RunConfig, slos_ms: dict[str, float], attainment: float = 0.9,
                 precision: float = 0.05) -> tuple[list[TargetResult], Capacity]:
    """The highest rate meeting the SLOs, to within ``precision`` (relative); every probe returned."""
    if not slos_ms:
        raise ValueError("a capacity search needs at least one SLO (--goodput ttft:MS, tpot:MS or e2el:MS)")
    if not 0 < attainment <= 1 or not 0 < precision < 1:
        raise ValueError("attainment must be in (0, 1] and precision in (0, 1)")
    capacity = Capacity(dict(slos_ms), attainment, precision, 0.0, "latency floor", arrivals(base))
    results: list[TargetResult] = []

    async def probe(cfg: RunConfig, role: str) -> bool:
        result = await measure(cfg, role)
        share = attained(result, slos_ms)
        passed = share >= attainment
        capacity.unit = rate_unit(result)
        capacity.probes.append({"role": role, "rate": cfg.rate, "throughput": completed_rate(result),
                                "request_throughput": result.summary["request_throughput"],
                                "attained": share, "passed": passed, "run_index": len(results)})
        results.append(result)
        return passed

    if not await probe(synchronous(base), "synchronous"):
        return results, capacity  # one request at a time already misses: no rate meets the SLO
    low = completed_rate(results[-1])
    await probe(throughput(base), "throughput")
    high = completed_rate(results[-1])
    if high <= low:  # the target completes no more at once than one at a time
        capacity.rate, capacity.limited_by = low, "throughput"
        return results, capacity
    if await probe(at_rate(base, high), "probe"):
        capacity.rate, capacity.limited_by = high, "throughput"
        return results, capacity
    while high - low > precision * high:
        mid = (low + high) / 2
        if await probe(at_rate(base, mid), "probe"):
            low = mid
        else:
            high = mid
    capacity.rate, capacity.limited_by = low, "slo"
    return results, capacity
