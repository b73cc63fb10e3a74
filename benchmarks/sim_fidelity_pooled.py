"""The simulator's fidelity over several checks: the rounds of several ``sim_fidelity.py`` results pooled.

A check compares 3 rounds (multi-turn 9) of each workload, on a host whose speed drifts 10-30% from one round to the
next, so one check's medians move by about the 15% its goal allows. Each round's own ratio (simulated / real, on the
profile the check fitted) is kept in its result; pooled over checks, their median shows where the model leans, and
their spread how far one round lands from it.

    python benchmarks/sim_fidelity_pooled.py benchmarks/results/sim_fidelity_xeon_repeat.json \\
        benchmarks/results/sim_fidelity_xeon_big_burst.json --save benchmarks/results/sim_fidelity_xeon_pooled.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import run_record

GOAL = 0.15  # sim_fidelity.py's: each figure within 15%
KIND = "with_frontend"  # the figures the checks quote: with this machine's served front end


def pooled(checks: dict[str, dict]) -> dict:
    """Per workload and figure: every round's ratio over ``checks`` (name: a sim_fidelity result), their median,
    10th and 90th percentiles, and each check's own figure."""
    rows: dict = {}
    for name, result in checks.items():
        if "fidelity" not in result:
            raise SystemExit(f"{name}: no fidelity part on this CPU (a --gpu or agreement-only run?)")
        for workload, kinds in result["fidelity"].items():
            for metric, figure in kinds[KIND].items():
                row = rows.setdefault(workload, {}).setdefault(metric, {"rounds": [], "checks": {}})
                row["rounds"] += [ratio for ratio in figure["rounds"] if ratio is not None]  # None: a real 0
                row["checks"][name] = figure["ratio"]
    for metrics in rows.values():
        for row in metrics.values():
            rounds = np.array(row["rounds"])
            row.update(median=float(np.median(rounds)), p10=float(np.quantile(rounds, 0.1)),
                       p90=float(np.quantile(rounds, 0.9)), within=bool(abs(np.median(rounds) - 1) <= GOAL))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="sim_fidelity.py results (their fidelity part)")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    checks = {path.stem: json.loads(path.read_text()) for path in args.results}
    rows = pooled(checks)
    for workload, metrics in rows.items():
        for metric, row in metrics.items():
            own = ", ".join(f"{ratio:.2f}" for ratio in row["checks"].values())
            print(f"{workload:13s} {metric:18s} {len(row['rounds']):3d} rounds: median {row['median']:.2f} "
                  f"(p10-p90 {row['p10']:.2f}-{row['p90']:.2f}); the checks' own {own}")
    held = [sum(abs(row["checks"][name] - 1) <= GOAL for metrics in rows.values() for row in metrics.values())
            for name in checks]
    figures = sum(len(metrics) for metrics in rows.values())
    within = sum(row["within"] for metrics in rows.values() for row in metrics.values())
    print(f"pooled: {within} of {figures} figures within {GOAL:.0%}; each check alone: "
          + ", ".join(f"{n} of {figures}" for n in held) + f" (median {statistics.median(held)})")
    if args.save:
        record = {**run_record(), "checks": list(checks), "goal": GOAL, "kind": KIND, "pooled": rows,
                  "held_per_check": dict(zip(checks, held))}
        args.save.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
