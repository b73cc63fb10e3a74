"""Routing at fleet scale, on simulated H100 replicas on the virtual clock (backends/sim/virtual.py): the gateway's
own policies at sizes no machine here can run for real.

1. ``scale``: multi-turn chat (production-stack's multi-round QA shape: a shared 1,000-token system prompt,
   200-token questions, 100-token answers, 6 turns, 2 s of thinking between them), 12 users per replica arriving
   at 1.5 per replica per second, the design's 12.3B model at 8 / 32 / 64 replicas, per policy.
2. ``llmd``: the shape of llm-d's published comparison (16 H100s, 150 customers x 6,000-token contexts,
   1,200-token queries, 1,000 tokens out, 3-60 QPS; there: output tok/s 8,730 precise / 6,944 approximate / 4,429
   load-only, P90 TTFT 0.54 / 31 / 93 s) with Llama-3.1-8B's shape (configs/llama-3.1-8b.json), 60 s of arrivals
   per rate: cache-aware with KV events (precise), without them (approximate), and least-outstanding (load only).

    python benchmarks/fleet_sim_routing.py --save benchmarks/results/fleet_sim_routing.json

``--policies`` takes ``cache_aware@COST`` for cache_aware at another ``load_cost_tokens`` (how much a cached prompt
token weighs against a request of load; ``auto`` to learn it), e.g. the sweep of
benchmarks/results/fleet_sim_load_cost.json:

    python benchmarks/fleet_sim_routing.py --skip llmd --policies round_robin,cache_aware@64,cache_aware@256,\
cache_aware@1024,cache_aware@auto --save benchmarks/results/fleet_sim_load_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import run_record

from backends.native.config import EngineConfig, SimulationConfig
from backends.sim.cli import routing_config
from backends.sim.profile import load_profile
from backends.sim.virtual import VirtualFleet, burst_workload, conversation_workload, engine_tokenizer
from loadtest.schedule import Schedule, arrival_offsets

FIGURES = ("completed", "output_throughput", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "p99_tpot_ms", "cached_token_rate")


def run(engine: EngineConfig, replicas: int, policy: str, requests: list, tokenizer, kv_events: bool = True) -> dict:
    """One simulated run; ``policy`` a name, or ``cache_aware@COST`` for its ``load_cost_tokens``."""
    started = time.perf_counter()
    name, _, cost = policy.partition("@")
    config = routing_config(name, [f"load_cost_tokens={cost}"] if cost else [])
    fleet = VirtualFleet(engine, replicas, config, tokenizer, kv_events=kv_events)
    result = fleet.run(requests)
    row = {k: result.summary[k] for k in FIGURES}
    row.update(steps=result.steps, simulated_s=result.virtual_s, host_s=time.perf_counter() - started)
    if (load_cost := getattr(fleet.policy, "load_cost", None)) is not None:
        row["load_cost_tokens"] = load_cost.tokens  # as configured, or as ``auto`` learnt it by the run's end
    print(f"  {policy:<22} {replicas:>3} replicas: {row['output_throughput']:>9,.0f} tok/s  TTFT p50/p90 "
          f"{row['median_ttft_ms']:>8,.0f}/{row['p90_ttft_ms']:>8,.0f} ms  cached {row['cached_token_rate']:.0%}  "
          f"({row['host_s']:.0f} s here)", flush=True)
    return row


def scale(sizes: list[int], policies: list[str], profile: str) -> dict:
    engine = EngineConfig(model_path="configs/llama-12.3b-gqa.json", simulate=SimulationConfig(profile=profile))
    tokenizer = engine_tokenizer(engine)
    out = {}
    for replicas in sizes:
        users = 12 * replicas
        arrivals = arrival_offsets(Schedule.poisson, users, rate=1.5 * replicas, seed=0)
        requests = conversation_workload(users, 6, 1000, 200, 100, arrivals, think_s=2.0)
        print(f"scale: {replicas} replicas, {users} conversations x 6 turns", flush=True)
        out[str(replicas)] = {policy: run(engine, replicas, policy, requests, tokenizer) for policy in policies}
    return out


def llmd(rates: list[float], seconds: float, profile: str, num_blocks: int | None = None) -> dict:
    engine = EngineConfig(model_path="configs/llama-3.1-8b.json", simulate=SimulationConfig(profile=profile),
                          max_model_len=8448, num_blocks=num_blocks)
    tokenizer = engine_tokenizer(engine)
    variants = {"precise (cache_aware, KV events)": ("cache_aware", True),
                "approximate (cache_aware, decisions only)": ("cache_aware", False),
                "load only (least_outstanding)": ("least_outstanding", True)}
    out = {}
    for rate in rates:
        n = int(rate * seconds)
        requests = burst_workload(n, 7200, 1000, arrival_offsets(Schedule.poisson, n, rate=rate, seed=0),
                                  prefix_len=6000, num_prefixes=150)
        print(f"llm-d shape: {rate:g} QPS, {n} requests, 16 replicas", flush=True)
        out[str(rate)] = {name: run(engine, 16, policy, requests, tokenizer, events)
                          for name, (policy, events) in variants.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,32,64")
    ap.add_argument("--policies", default="round_robin,least_outstanding,prefix_affinity,cache_aware")
    ap.add_argument("--rates", default="3,10,30,60", help="llm-d shape: QPS")
    ap.add_argument("--seconds", type=float, default=60.0, help="llm-d shape: seconds of arrivals per rate")
    ap.add_argument("--num-blocks", type=int, help="llm-d shape: KV blocks per replica (default: what an H100 "
                    "holds); fewer puts the prefix caches under pressure")
    ap.add_argument("--kv-cache-reuse", type=float, metavar="SHARE", help="the H100 profile with this share of the "
                    "reads of KV blocks several of a step's sequences share served by the caches (as shipped: 0, not "
                    "measured on a GPU; a CPU's: 1)")
    ap.add_argument("--skip", action="append", default=[], choices=["scale", "llmd"])
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    record = run_record()
    with tempfile.TemporaryDirectory() as tmp:
        profile = "h100"
        if args.kv_cache_reuse is not None:
            load_profile(profile).model_copy(update={"kv_cache_reuse": args.kv_cache_reuse}).save(Path(tmp) / "h100.json")
            profile = str(Path(tmp) / "h100.json")
        if "scale" not in args.skip:
            record["scale"] = scale([int(x) for x in args.sizes.split(",")], args.policies.split(","), profile)
        if "llmd" not in args.skip:
            record["llmd"] = llmd([float(x) for x in args.rates.split(",")], args.seconds, profile, args.num_blocks)
            record["llmd_num_blocks"] = args.num_blocks
    if args.save:
        args.save.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
