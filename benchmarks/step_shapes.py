"""How much of a fidelity check's spread is this host's: steps of one size in several shapes, interleaved.

The native engine served here (``burstgate serve``, SmolLM2, the CPU defaults, its steps traced) takes bursts whose
every prompt step holds 2,048 fresh tokens (the scheduler's budget) in four shapes: 16 prompts of 128, 8 of 256,
4 of 512 (the paper's burst), 2 of 1,024. Round by round each shape runs once, the order reversed every other
round, so every shape meets the host early and late. Per shape and round: the median of its full steps' seconds,
and against ``--profile`` (a fitted CPU profile), measured over modelled. A shape whose steps move from round to
round as much as its ratio differs from the other shapes' tells the host's drift from the model's error; the
shapes' order within one round tells what attention's share of a step costs.

    python benchmarks/step_shapes.py --profile benchmarks/results/sim_profile_cpu_xeon_repeat.json \\
        --save benchmarks/results/step_shapes_xeon.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import loadtest, positive_int, run_record
from served_burst import MODEL, serve_model

from backends.sim import fit as fitting
from backends.sim.profile import StepProfile
from backends.sim.step_time import StepTimeModel

STEP_TOKENS = 2048  # the CPU default's max_num_batched_tokens: a burst's prompt steps are full
SHAPES = {"16x128": 128, "8x256": 256, "4x512": 512, "2x1024": 1024}  # prompts per step x prompt length
STEPS_PER_BURST = 8  # full steps each burst fills
SEED = 3000  # none of sim_fidelity's seeds: no prompt the prefix cache holds


def serve_rounds(out: Path, rounds: int) -> tuple[dict, list[tuple[str, int, int, int]]]:
    """Every shape's burst each round on one traced server: the trace's steps, and per burst (shape, round, its
    first step and the step after its last)."""
    trace = out / "steps.jsonl"
    marks = []
    with contextlib.ExitStack() as stack:
        url = serve_model(stack, [{"kind": "native", "name": "native", "step_trace": str(trace)}])
        loadtest(f"{url}#{MODEL}", out / "warmup", "--requests", "4", "--input-len", "64", "--output-len", "4",
                 "--seed", str(SEED - 1))
        for r in range(rounds):
            order = list(SHAPES) if r % 2 == 0 else list(reversed(SHAPES))
            for i, name in enumerate(order):
                length = SHAPES[name]
                before = _steps(trace)
                loadtest(f"{url}#{MODEL}", out / f"{name}-{r}", "--requests",
                         str(STEPS_PER_BURST * STEP_TOKENS // length), "--input-len", str(length), "--output-len", "2",
                         "--seed", str(SEED + 10 * r + i), log=out / f"{name}-{r}.log")
                marks.append((name, r, before, _steps(trace)))
    return fitting.load_steps(trace), marks


def _steps(trace: Path) -> int:
    """The trace's steps so far (its lines of one step each, flushed by each run's end, where the engine idles)."""
    return sum(line.startswith("[") for line in trace.read_text().splitlines()) if trace.exists() else 0


def by_shape(steps: dict, marks: list[tuple[str, int, int, int]], profile: StepProfile) -> dict:
    """Per shape: each round's median seconds of its full prompt steps and measured / modelled, and their medians."""
    points = fitting.points_from_steps(steps)
    rows: dict = {name: {"rounds": []} for name in SHAPES}
    for name, r, begin, end in marks:
        full = [p for p in points[begin:end] if not p.work.decode_only and p.work.tokens == STEP_TOKENS]
        if not full:
            raise SystemExit(f"{name}, round {r}: no step of {STEP_TOKENS} tokens (a max_num_batched_tokens other "
                             "than the CPU default's?)")
        model = StepTimeModel(profile, full[0].cost)
        rows[name]["rounds"].append({"round": r, "steps": len(full),
                                     "seconds": statistics.median(p.seconds for p in full),
                                     "ratio": statistics.median(p.seconds / model.seconds_of(p.work) for p in full)})
    for row in rows.values():
        row["seconds"] = statistics.median(x["seconds"] for x in row["rounds"])
        row["ratio"] = statistics.median(x["ratio"] for x in row["rounds"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, required=True, help="a fitted CPU profile (JSON) to model the steps on")
    ap.add_argument("--rounds", type=positive_int, default=4)
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    profile = StepProfile.model_validate_json(args.profile.read_text())
    steps, marks = serve_rounds(Path(tempfile.mkdtemp(prefix="step-shapes-")), args.rounds)
    rows = by_shape(steps, marks, profile)
    for name, row in rows.items():
        each = "  ".join(f"r{x['round']} {x['seconds']:.2f} s x{x['ratio']:.2f}" for x in row["rounds"])
        print(f"{name:7s} {each} | median {row['seconds']:.2f} s, x{row['ratio']:.2f}")
    if args.save:
        args.save.write_text(json.dumps({**run_record(), "profile": str(args.profile), "step_tokens": STEP_TOKENS,
                                         "order": [m[:2] for m in marks], "shapes": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
