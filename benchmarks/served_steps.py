"""The native engine's steps timed while it serves on this machine: the data of the CPU profile fitted on served
steps (``burstgate sim fit --from`` the trace this writes).

``burstgate serve`` (SmolLM2, the CPU defaults, ``step_trace`` on) loaded by ``burstgate loadtest run`` with
workloads of the kinds the simulator's fidelity check runs (bursts, a Poisson run, conversations) but other
shapes, sizes and seeds, so that ``sim_fidelity.py``'s workloads stay held out of the fit:

    python benchmarks/served_steps.py --save benchmarks/results/sim_cpu_served_steps_zen4_light_sampler.jsonl
    burstgate sim fit --from benchmarks/results/sim_cpu_served_steps_zen4_light_sampler.jsonl \\
        --name cpu-zen4-2c-served --out backends/sim/profiles/cpu-zen4-2c-served.json
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import loadtest
from served_burst import MODEL, serve_deployment

# burstgate's sim fit --native bursts (backends/sim/fit.py CPU_BURSTS) as served bursts, then arrivals
WORKLOADS = {
    **{f"burst_{n}x{i}_{o}": ["--requests", str(n), "--input-len", str(i), "--output-len", str(o)]
       for n, i, o in [(1, 256, 32), (4, 512, 32), (16, 256, 32), (32, 128, 48), (8, 1024, 16), (64, 64, 32)]},
    # full steps of prompts of a few hundred tokens: at equal tokens, many short prompts take longer than a few long
    # ones (the model's attention term says the opposite), and the bursts above have 6 full steps of short prompts
    # to 4 of long ones
    "burst_24x384_32": ["--requests", "24", "--input-len", "384", "--output-len", "32"],
    # decodes of about ten sequences, between the bursts' 4 and 16, which a fit without them interpolates (8 users'
    # conversations decode so)
    "burst_10x320_64": ["--requests", "10", "--input-len", "320", "--output-len", "64"],
    # steps of 2,048 fresh prompt tokens, the paper's burst's and the mixed burst's: most of the bursts above fill a
    # step or two so, and a fit without more of them sets the prefill's efficiency on smaller steps
    "burst_16x768_24": ["--requests", "16", "--input-len", "768", "--output-len", "24"],
    "poisson": ["--requests", "40", "--input-len", "256", "--output-len", "24", "--rate", "0.5", "--schedule", "poisson"],
    # prompts a little over the fused step's 128 rows arriving beside decodes: steps run layer by layer with few prompt
    # tokens, of whose time the launches are a large share (the bursts' steps launched hold hundreds of prompt tokens)
    "poisson_short": ["--requests", "40", "--input-len", "160", "--output-len", "40", "--rate", "1.2", "--schedule",
                      "poisson"],
    "multi_turn": ["--endpoint", "chat", "--users", "3", "--turns", "3", "--system-prompt-len", "128", "--question-len",
                   "64", "--output-len", "24"],
}
# --long-turns: decodes of several conversations with 300-600 tokens of context each, which the shapes above lack,
# and their turns' prompts over those contexts (attention over a cached history)
LONG_TURNS = ["--endpoint", "chat", "--users", "6", "--turns", "4", "--system-prompt-len", "320", "--question-len", "40",
              "--output-len", "40"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", type=Path, required=True, help="where the trace goes (JSON lines)")
    ap.add_argument("--long-turns", action="store_true", help="add conversations with long contexts (LONG_TURNS)")
    args = ap.parse_args()
    workloads = {**WORKLOADS, **({"multi_turn_long": LONG_TURNS} if args.long_turns else {})}
    work = Path(tempfile.mkdtemp(prefix="served-steps-"))
    trace = work / "steps.jsonl"
    with contextlib.ExitStack() as stack:
        url = serve_deployment(stack, {"kind": "native", "step_trace": str(trace)})
        for name, options in workloads.items():
            result = loadtest(f"{url}#{MODEL}", work / name, *options, "--seed", "7", "--warmup", "1",
                              log=work / f"{name}.log")
            print(f"{name:24s} {result['output_throughput']:7.1f} tok/s", flush=True)
    shutil.copy(trace, args.save)  # the server closed the trace as it stopped
    print(f"{sum(1 for _ in args.save.open()) - 1} steps -> {args.save}")


if __name__ == "__main__":
    main()
