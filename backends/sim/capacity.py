"""How many replicas of a model, on which GPU type, carry a given traffic within an SLO: the static plan's
tensor-parallel size per GPU type (the fewest GPUs per replica that hold the model), then the fewest replicas
whose simulated fleet (``virtual.py``) meets every SLO, found by doubling and then bisection over the replica
count (latency falls as replicas are added), with the curve behind the answer."""

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

    @property
    def gpus(self) -> int | None:
        return None if self.replicas is None else self.replicas * self.tensor_parallel_size

    def as_dict(self, slos: dict[str, float]) -> dict:
        return {"gpu": self.gpu, "tensor_parallel_size": self.tensor_parallel_size, "replicas": self.replicas,
                "gpus": self.gpus, "why": self.why,
                "curve": [{"replicas": p.replicas, "meets": p.meets, **p.figures(slos)} for p in self.curve]}


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
               tokenizer: Tokenizer | None = None) -> FleetPlan:
    """The fewest replicas of ``engine``'s model on the device ``profile`` names that serve ``requests`` within
    ``slos``, each replica split across ``tensor_parallel_size`` GPUs (None: the static plan's choice for the
    GPU type ``profile`` names, the fewest that hold the model); ``tokenizer``: the engines', if loaded already."""
    from backends.native.planner import plan
    from backends.native.weights import open_checkpoint

    tp = tensor_parallel_size
    if tp is None:
        static = plan(open_checkpoint(engine.model_path).config, profile, max_num_seqs=engine.max_num_seqs,
                      max_num_batched_tokens=engine.max_num_batched_tokens)
        if not static.fits:
            return FleetPlan(profile, static.tensor_parallel_size, None, why=static.why or "the model does not fit")
        tp = static.tensor_parallel_size
    simulated = engine.model_copy(update={"simulate": SimulationConfig(profile=profile, real_time=False),
                                          "tensor_parallel_size": tp})
    tokenizer = tokenizer or engine_tokenizer(engine)

    def run(replicas: int) -> dict:
        return VirtualFleet(simulated, replicas, routing, tokenizer).run(requests).summary

    replicas, curve = fewest_replicas(run, slos, max_replicas)
    why = "" if replicas else f"{max_replicas} replicas do not meet the SLO"
    return FleetPlan(profile, tp, replicas, curve, why)
