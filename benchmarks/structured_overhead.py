"""What structured outputs cost: a burst of JSON-schema requests against the same burst unconstrained, on the
native engine behind its own HTTP server (``burstgate serve``), rounds interleaved.

Every request of a burst is sent at once (chat, non-streamed, greedy) and generates exactly ``--output-len``
tokens: the unconstrained ones with ``ignore_eos``, the constrained ones under a schema that cannot close
within that many tokens (an array of at least 200 strings), so both bursts decode the same token count and
the ratio is the grammar's cost alone (xgrammar's bitmask per step and its matcher updates). Prompts are
fresh in every round (no prefix-cache hits); one warm-up round of each kind is not counted. Prints output
tok/s per round and the ratio of the medians; ``--save`` writes the rows, the command and the machine.

    python benchmarks/structured_overhead.py --requests 64 --output-len 64 --rounds 3 \\
        --save benchmarks/results/structured_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import burstgate, free_port, run_record, serving

MODEL = "SmolLM2-135M-Instruct"
# No length bounds on the strings: xgrammar 0.2.8 unrolls "maxLength" into states whose masks it cannot
# cache, and filling one then takes ~8 ms per sequence per step on a 2-core CPU (a 0.62x burst here), against
# ~0.02 ms inside an unbounded string. Run with --max-length 12 to see that cost.
SCHEMA = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string"}, "minItems": 200}},
          "required": ["words"], "additionalProperties": False}
TOPICS = ["rivers", "birds", "cities", "colours", "tools", "fruits", "stars", "trees", "metals", "games"]


def schema(max_length: int | None) -> dict:
    if max_length is None:
        return SCHEMA
    words = {**SCHEMA["properties"]["words"], "items": {"type": "string", "maxLength": max_length}}
    return {**SCHEMA, "properties": {"words": words}}


def body(kind: str, round_no: int, i: int, args) -> dict:
    prompt = f"Round {round_no}, list {i}: name many {TOPICS[i % len(TOPICS)]} as JSON."
    out = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.output_len,
           "temperature": 0}
    if kind == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "words",
                                                                         "schema": schema(args.max_length)}}
    else:
        out["ignore_eos"] = True
    return out


async def burst(url: str, kind: str, round_no: int, args) -> dict:
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=args.requests)) as client:
        start = time.perf_counter()
        replies = await asyncio.gather(*(client.post(f"{url}/v1/chat/completions",
                                                     json=body(kind, round_no, i, args))
                                         for i in range(args.requests)))
        elapsed = time.perf_counter() - start
    for r in replies:
        r.raise_for_status()
    usage = [r.json()["usage"] for r in replies]
    reasons = {r.json()["choices"][0]["finish_reason"] for r in replies}
    tokens = sum(u["completion_tokens"] for u in usage)
    row = {"kind": kind, "round": round_no, "seconds": elapsed, "output_tokens": tokens,
           "output_tok_s": tokens / elapsed, "finish_reasons": sorted(reasons)}
    print(f"round {round_no} {kind:13s} {tokens:6d} tokens in {elapsed:6.2f} s = {row['output_tok_s']:7.1f} tok/s "
          f"finish {','.join(row['finish_reasons'])}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-length", type=int, help="bound every string of the schema to this many characters")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    port = free_port()
    kinds = ["unconstrained", "json_schema"]
    with serving(burstgate("serve", "--port", str(port), "--log-level", "warning"), port) as url:
        for kind in kinds:  # warm-up: kernels, the grammar's compilation and cache, connections
            asyncio.run(burst(url, kind, 0, args))
        rows = [asyncio.run(burst(url, kind, r, args)) for r in range(1, args.rounds + 1)
                for kind in (kinds if r % 2 else kinds[::-1])]  # interleaved, alternating which goes first
    median = {k: statistics.median(r["output_tok_s"] for r in rows if r["kind"] == k) for k in kinds}
    ratio = median["json_schema"] / median["unconstrained"]
    print(f"\njson_schema / unconstrained output tok/s = {ratio:.3f} (goal >= 0.9); medians "
          f"{median['json_schema']:.1f} / {median['unconstrained']:.1f}")
    if args.save:
        args.save.write_text(json.dumps({**run_record(), "rows": rows, "median_output_tok_s": median, "ratio": ratio},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
