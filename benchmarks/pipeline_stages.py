"""Where a pipeline's time goes: the mixed burst on one process and split over ranks, in process (no HTTP:
served_burst.py compares splits through their servers), with each rank's clock.

Models (``--model``): ``smollm2``, the embedded SmolLM2 (9 query / 3 KV heads: tensor parallelism splits it 3
ways, not 2), against pipeline parallel 2 and 3 and tensor parallel 3; ``design-eighth``, the design's 12.3B GQA
shape (40 query / 8 KV heads) at 1/8 of its width and 8 of its 40 layers with random weights and SmolLM2's
vocabulary, against tensor parallel 2 and pipeline parallel 2.

Each split runs on the same CPUs (its ranks share them: one thread each on 2 cores, two for the single process).
For every rank of a split model: its steps, the time inside them, the part of it spent waiting for the previous
stage's hidden states (that stage's work, the transfer and the bubble), the bytes it sent on; for the driver,
also its host time (scheduling, sampling) outside the steps. Rounds interleave the splits, fresh prompts each
round (the round is the seed); each engine is built for its run and warms up before it.

    python benchmarks/pipeline_stages.py --model smollm2 --rounds 2 --save benchmarks/results/pipeline_stages_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import run_record

from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine, start_engine
from loadtest.workload import synthetic

DESIGN = Path(__file__).resolve().parent.parent / "configs" / "llama-12.3b-gqa.json"
MODELS = {  # (the engine's model, the splits compared)
    "smollm2": ({}, {"one process": {}, "pp2": {"pipeline_parallel_size": 2}, "pp3": {"pipeline_parallel_size": 3},
                     "tp3": {"tensor_parallel_size": 3}}),
    "design-eighth": ({"model_path": str(DESIGN), "load_format": "dummy",
                       "hf_overrides": {"hidden_size": 640, "intermediate_size": 1728, "num_hidden_layers": 8,
                                        "head_dim": 16, "vocab_size": 49152}},
                      {"one process": {}, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}),
}
MIXED = {"n": 64, "input_len": (32, 512), "output_len": (16, 256)}  # served_burst.py's mixed burst


def burst(engine: LLMEngine, seed: int) -> dict:
    """The mixed burst offline on ``engine``: wall time, output tokens, and each rank's clock over it."""
    specs = synthetic(engine.tokenizer, seed=seed, **MIXED)
    prompts = [engine.tokenizer.encode(s.prompt) for s in specs]
    params = [SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True) for s in specs]
    before = clocks(engine)
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - started
    after = clocks(engine)
    ranks = [{key: a[key] - b[key] for key in a} for a, b in zip(after, before)]
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall, "ranks": ranks}


def clocks(engine: LLMEngine) -> list[dict]:
    runner = engine.runner
    return runner.call("stage_clock") if hasattr(runner, "call") else [runner.stage_clock()]


def summary(runs: list[dict]) -> dict:
    """Medians over rounds; per rank, shares of the wall time."""
    wall = statistics.median(r["wall_s"] for r in runs)
    out = {"output_tok_s": statistics.median(r["output_tok_s"] for r in runs), "wall_s": wall, "ranks": []}
    for i in range(len(runs[0]["ranks"])):
        rank = {key: statistics.median(r["ranks"][i][key] for r in runs) for key in runs[0]["ranks"][i]}
        rank["busy_share"] = rank["busy_s"] / wall
        rank["waiting_share"] = rank["waiting_s"] / wall
        rank["outside_steps_share"] = 1 - rank["step_s"] / wall  # the driver's host work; a worker's idle time
        out["ranks"].append(rank)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    model, splits = MODELS[args.model]
    runs: dict[str, list[dict]] = {name: [] for name in splits}
    for round_ in range(args.rounds):
        for name in list(splits) if round_ % 2 == 0 else list(reversed(splits)):
            # built anew each round: a process holds one process group, so one split engine at a time
            engine = start_engine(EngineConfig(dtype="float32", max_model_len=1024, **model, **splits[name]))
            try:
                runs[name].append(burst(engine, seed=round_))
            finally:
                engine.close()
            print(f"round {round_} {name}: {runs[name][-1]['output_tok_s']:.1f} tok/s", flush=True)
    results = {name: summary(r) for name, r in runs.items()}
    base = results["one process"]["output_tok_s"]
    for name, r in results.items():
        ranks = ", ".join(f"rank {i}: busy {k['busy_share']:.0%}, waiting {k['waiting_share']:.0%}, outside steps "
                          f"{k['outside_steps_share']:.0%}" for i, k in enumerate(r["ranks"]))
        print(f"{name:>12}: {r['output_tok_s']:6.1f} tok/s ({r['output_tok_s'] / base:.2f}x)  {ranks}")
    if args.save:
        record = {**run_record(), "model": args.model, "engine": model, "splits": splits, "workload": MIXED,
                  "dtype": "float32", "rounds": args.rounds, "results": results,
                  "raw": runs}
        args.save.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
