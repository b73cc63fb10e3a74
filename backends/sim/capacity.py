"""How many replicas of a model, on which GPU type, carry a given traffic within an SLO: for every tensor-parallel
size from the fewest GPUs per replica that hold the model up to a node's, the fewest replicas whose simulated
fleet (``virtual.py``) meets every SLO, found by doubling and then bisection over the replica count (latency falls
as replicas are added); the answer is the size that needs the fewest GPUs in all (at equal counts, the one with
more room under its SLOs), with the curve behind it and the other sizes beside it."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from backends.native.config import EngineConfig, SimulationConfig
from backends.sim.virtual import SimRequest, VirtualFleet, engine_tokenizer
from backends.tokenizer import Tokenizer
from gateway.routing.policy import PolicyConfig

SLO_PATTERN = re.compile(r"^(ttft|tpot|itl|e2el)_(mean|median|p50|p90|p95|p99)_ms$")


def parse_slo(text: str) -> tuple[str, float]:
    """``ttft_p99_ms=2000`` -> (the summary's key ``p99_ttft_ms``, 2000.0)."""
    name, sep, value = text.partition("=")
    match = SLO_PATTERN.match(name.strip())
    if not sep or match is None:
        raise ValueError(f"SLO {text!r}: write METRIC_STAT_ms=LIMIT, METRIC one of ttft, tpot, itl, e2el and STAT "
                         "one of mean, median, p50, p90, p95, p99 (e.g. ttft_p99_ms=2000)")
    metric, stat = match.groups()
    try:
        limit = float(value)
    except ValueError:
        raise ValueError(f"SLO {text!r}: {value!r} is not a number of milliseconds") from None
    if limit <= 0:
        raise ValueError(f"SLO {text!r}: the limit must be positive")
    return f"{'median' if stat == 'p50' else stat}_{metric}_ms", limit


@dataclass
class FleetPoint:
    """One simulated fleet size and what it measured."""

    replicas: int
    meets: bool
    summary: dict

    def figures(self, slos: dict[str, float]) -> dict:
        keys = {"output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                "p99_tpot_ms", *slos}
        return {k: self.summary[k] for k in sorted(keys)}


@dataclass
class FleetPlan:
    """The answer for one GPU type: replicas of ``tensor_parallel_size`` GPUs each, and the curve behind it."""

    gpu: str
    tensor_parallel_size: int
    replicas: int | None  # the fewest that meet every SLO; None: not within max_replicas
    curve: list[FleetPoint] = field(default_factory=list)
    why: str = ""
    others: list[FleetPlan] = field(default_factory=list)  # the other tensor-parallel sizes tried

    @property
    def gpus(self) -> int | None:
        return None if self.replicas is None else self.replicas * self.tensor_parallel_size

    def headroom(self, slos: dict[str, float]) -> float:
        """The chosen fleet's largest figure against its limit (lower: more room under the SLOs)."""
        chosen = next(p for p in self.curve if p.replicas == self.replicas)
        return max((chosen.summary[key] / limit for key, limit in slos.items()), default=0.0)

    def as_dict(self, slos: dict[str, float]) -> dict:
        return {"gpu": self.gpu, "tensor_parallel_size": self.tensor_parallel_size, "replicas": self.replicas,
                "gpus": self.gpus, "why": self.why,
                "curve": [{"replicas": p.replicas, "meets": p.meets, **p.figures(slos)} for p in self.curve],
                "other_tensor_parallel_sizes": [{k: v for k, v in other.as_dict(slos).items() if k != "gpu"}
                                                for other in self.others]}


def meets(summary: dict, slos: dict[str, float]) -> bool:
    """Every request answered, and every SLO (summary key -> ms) held."""
    return summary["failed"] == 0 and all(summary[key] <= limit for key, limit in slos.items())


def fewest_replicas(run: Callable[[int], dict], slos: dict[str, float], max_replicas: int) -> tuple[int | None, list[FleetPoint]]:
    """The fewest replicas in 1..``max_replicas`` whose run meets ``slos`` (doubling, then bisection), and every
    size tried, in order of size."""
    tried: dict[int, FleetPoint] = {}

    def attempt(n: int) -> bool:
        if n not in tried:
            summary = run(n)
            tried[n] = FleetPoint(n, meets(summary, slos), summary)
        return tried[n].meets

    low, high = 0, 1  # low fails (0 replicas: nothing served), high is the next to try
    while not attempt(high):
        if high >= max_replicas:
            return None, [tried[n] for n in sorted(tried)]
        low, high = high, min(2 * high, max_replicas)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if attempt(mid) else (mid, high)
    return high, [tried[n] for n in sorted(tried)]


def plan_fleet(engine: EngineConfig, profile: str, requests: list[SimRequest], slos: dict[str, float],
               routing: PolicyConfig, max_replicas: int = 64, tensor_parallel_size: int | None = None,
               tokenizer: Tokenizer | None = None, max_tensor_parallel_size: int = 8) -> FleetPlan:
    """The fewest GPUs of the type ``profile`` names that serve ``requests`` within ``slos``: replicas of
    ``engine``'s model, each split across ``tensor_parallel_size`` GPUs, or (None) across each size the model takes
    from the fewest GPUs that hold it up to ``max_tensor_parallel_size`` (a node), the best of them returned with
    the others in ``others``; ``tokenizer``: the engines', if loaded already."""
    from backends.native.gpus import GPUS
    from backends.native.parallel import can_split
    from backends.native.planner import TP_SIZES, plan
    from backends.native.weights import default_model_path, open_checkpoint
    from backends.sim.profile import load_profile

    if tensor_parallel_size is not None:
        return _plan_at(engine, profile, requests, slos, routing, max_replicas, tensor_parallel_size,
                        tokenizer or engine_tokenizer(engine))
    config = open_checkpoint(engine.model_path or default_model_path()).config
    smallest = 1  # a profile of no GPU type: its replicas say themselves whether the model fits
    if load_profile(profile).memory_bytes is None:  # a CPU's: one process a replica, nothing to split over
        max_tensor_parallel_size = 1
    if profile in GPUS:
        static = plan(config, profile, max_num_seqs=engine.max_num_seqs,
                      max_num_batched_tokens=engine.max_num_batched_tokens)
        if not static.fits:
            return FleetPlan(profile, static.tensor_parallel_size, None, why=static.why or "the model does not fit")
        smallest = static.tensor_parallel_size
    sizes = [tp for tp in TP_SIZES if smallest <= tp <= max_tensor_parallel_size
             and can_split(config, tp)]
    tokenizer = tokenizer or engine_tokenizer(engine)
    plans: list[FleetPlan] = []
    for tp in sizes:
        answered = [p for p in plans if p.gpus is not None]
        fewest = min(answered, key=lambda p: p.gpus or 0) if answered else None  # gpus: set for all answered
        limit = min(max_replicas, (fewest.gpus or 0) // tp) if fewest else max_replicas  # never more GPUs than the best
        if limit < 1:
            break
        plans.append(_plan_at(engine, profile, requests, slos, routing, limit, tp, tokenizer))
        if plans[-1].replicas is None and fewest is not None and limit < max_replicas:
            plans[-1].why = f"needs more GPUs than TP {fewest.tensor_parallel_size}'s {fewest.gpus}"
    answered = [p for p in plans if p.replicas is not None]
    best = min(answered, key=lambda p: (p.gpus, p.headroom(slos))) if answered else plans[0]
    best.others = [p for p in plans if p is not best]
    return best


def _plan_at(engine: EngineConfig, profile: str, requests: list[SimRequest], slos: dict[str, float],
             routing: PolicyConfig, max_replicas: int, tp: int, tokenizer: Tokenizer) -> FleetPlan:
    simulate = (engine.simulate or SimulationConfig(profile=profile)).model_copy(
        update={"profile": profile, "real_time": False})  # the engine's own spread and seed, if it has them
    simulated = engine.model_copy(update={"simulate": simulate, "tensor_parallel_size": tp})

    def run(replicas: int) -> dict:
        return VirtualFleet(simulated, replicas, routing, tokenizer).run(requests).summary

    replicas, curve = fewest_replicas(run, slos, max_replicas)
    why = "" if replicas else f"{max_replicas} replicas of TP {tp} do not meet the SLO"
    return FleetPlan(profile, tp, replicas, curve, why)
