"""Conversation turns' first steps in served runs, by what passed the front end while they ran.

Multi-turn's TTFT in a fidelity check (sim_fidelity.py) rests on turn steps: one user's question of a few dozen
tokens over its cached history, run alone because its answer ended a step before the other users' (its first
turn reached the engine first). While it runs, the other users' next turns pass the front end (HTTP, the gateway,
tokenizing) on the same two cores. This reads the served step traces of fidelity checks (their runs'
``steps.jsonl``, the check's and its fit share's steps), takes every single-sequence prompt step of up to 128 new
tokens over a cached prefix, and splits them by how many prompt chunks the next step holds (after a turn step,
the requests that reached the engine while it ran; a turn is one chunk): measured over modelled on each check's own
profile, per group.

Where a trace records how many requests each step admitted (``Batch.admitted``, traced since 2026-11-30), every
prompt step is also split by that count (``ADMITTING``): a step that opens many requests' streams on the engine's
cores would run long against the model. In the traces that record it, steps admitting two or more ran at most 6%
longer than steps admitting one, and a fitted cost per admission came out zero (docs/performance.md).

    python benchmarks/turn_steps.py \\
        --check benchmarks/results/sim_served_trace_xeon_front_end.jsonl.gz \\
            benchmarks/results/sim_profile_cpu_xeon_front_end.json ... \\
        --save benchmarks/results/turn_steps_xeon.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import run_record

from backends.sim import fit as fitting
from backends.sim.profile import StepProfile

TURN_TOKENS = 128  # a turn's question and template: the steps a CPU runs whole (fused_rows)
GROUPS = {"0-1": range(0, 2), "2-3": range(2, 4), "4 or more": range(4, 10**6)}  # prompts the next step admits
ADMITTING = {"0": range(0, 1), "1": range(1, 2), "2-3": range(2, 4), "4 or more": range(4, 10**6)}  # requests a step admits


def turn_steps(steps: list, points: list[fitting.StepPoint], profile: StepProfile) -> dict[str, list[float]]:
    """Measured / modelled seconds of the turn steps among ``steps`` (one sequence, up to ``TURN_TOKENS`` new tokens
    over a cached prefix; ``points`` are their fit points), by how many prompts the step after each admits
    (``GROUPS``)."""
    counted = ((sum(1 for n in next_query_lens if n > 1), point)
               for (query_lens, context_lens, *_), point, (next_query_lens, *_) in zip(steps, points, steps[1:])
               if len(query_lens) == 1 and 1 < query_lens[0] <= min(TURN_TOKENS, context_lens[0] - 1))
    return _ratios_by_group(profile, GROUPS, counted)


def admitting_steps(steps: list, points: list[fitting.StepPoint], profile: StepProfile) -> dict[str, list[float]] | None:
    """Measured / modelled seconds of the prompt steps among ``steps`` by how many requests each admitted
    (``ADMITTING``); None for a trace that does not record it."""
    if not steps or len(steps[0]) < 6:
        return None
    counted = ((admitted, point) for (query_lens, *_, admitted), point in zip(steps, points)
               if any(n > 1 for n in query_lens))
    return _ratios_by_group(profile, ADMITTING, counted)


def _ratios_by_group(profile: StepProfile, groups: dict[str, range],
                     counted: Iterable[tuple[int, fitting.StepPoint]]) -> dict[str, list[float]]:
    """Measured / modelled seconds of each point, in the group of ``groups`` whose range holds its count."""
    by_group: dict[str, list] = {group: [] for group in groups}
    for count, point in counted:
        by_group[next(g for g, counts in groups.items() if count in counts)].append(point)
    return {group: list(1 / (1 + fitting.relative_errors(profile, points))) if points else []
            for group, points in by_group.items()}


def _medians(ratios: dict[str, list[float]]) -> dict[str, dict]:
    return {group: {"steps": len(r), "median_ratio": statistics.median(r) if r else None} for group, r in ratios.items()}


def _line(groups: dict[str, dict]) -> str:
    return "  ".join(f"{group}: {row['median_ratio']:.2f} ({row['steps']})" for group, row in groups.items() if row["steps"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", nargs=2, action="append", required=True, metavar=("TRACE", "PROFILE"),
                    help="a fidelity check's served step trace (its runs' steps.jsonl, or gzipped) and its profile")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()

    checks = {}
    for trace_path, profile_path in args.check:
        try:
            trace = fitting.load_steps(trace_path)
            profile = StepProfile.model_validate_json(Path(profile_path).read_text())
        except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            raise SystemExit(f"{trace_path} / {profile_path}: {exc}") from None
        steps, points = trace["steps"], fitting.points_from_steps(trace)  # the model's work of each step, once
        groups = _medians(turn_steps(steps, points, profile))
        by_admitted = admitting_steps(steps, points, profile)
        admitting = None if by_admitted is None else _medians(by_admitted)
        name = Path(trace_path).name
        checks[name] = {"profile": profile_path, "groups": groups, "admitting": admitting}
        print(name, "turn steps by the next step's prompts:", _line(groups), flush=True)
        if admitting is not None:
            print(name, "prompt steps by requests admitted:", _line(admitting), flush=True)
    if args.save:
        record = run_record() | {"turn_tokens": TURN_TOKENS, "checks": checks}
        args.save.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
