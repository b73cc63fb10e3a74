"""The first burst after start-up against the second, with the engine's warm-up on and off.

For each setting a fresh ``burstgate serve`` (the embedded default, its config's ``warmup`` set) answers two
bursts of the same shape, fresh prompts each: N completions at once, prompts of varied lengths (so steps
take many token counts), fixed output (ignore_eos). Printed: each burst's output tok/s and median TTFT,
and first / second. With warm-up the first burst should run as fast as the second (issue #17); without it,
the first pays for kernel builds (oneDNN's, one per matmul shape), allocator growth and lazy imports.

    python benchmarks/warmup_effect.py --requests 64 --output-len 64 --save benchmarks/results/warmup_effect.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import burstgate, free_port, run_record, serving

MODEL = "SmolLM2-135M-Instruct"


async def burst(url: str, tag: str, args) -> dict:
    async def one(client: httpx.AsyncClient, i: int) -> float:
        # lengths vary (10-250 tokens), so steps take many token counts; the tag up front: no prefix reuse
        prompt = f"{tag} story {i}:" + " once upon a time in a city of towers," * (1 + i * 37 % 24)
        body = {"model": MODEL, "prompt": prompt,
                "max_tokens": args.output_len, "ignore_eos": True, "stream": True}
        start = time.perf_counter()
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            ttft = None
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: {"):
                    ttft = time.perf_counter() - start
        return ttft

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=args.requests)) as client:
        start = time.perf_counter()
        ttfts = await asyncio.gather(*(one(client, i) for i in range(args.requests)))
        elapsed = time.perf_counter() - start
    return {"output_tok_s": args.requests * args.output_len / elapsed, "median_ttft_ms": statistics.median(ttfts) * 1000}


def measure(warmup: bool, args) -> dict:
    cfg = Path(tempfile.mkdtemp()) / "serve.yaml"
    cfg.write_text(f"models:\n  - name: {MODEL}\n    deployments:\n      - kind: native\n        warmup: {str(warmup).lower()}\n")
    port = free_port()
    started = time.perf_counter()
    with serving(burstgate("serve", "--config", str(cfg), "--port", str(port), "--log-level", "warning"), port) as url:
        ready_s = time.perf_counter() - started
        first, second = (asyncio.run(burst(url, f"w{int(warmup)}-{k}", args)) for k in ("a", "b"))
    row = {"warmup": warmup, "ready_s": ready_s, "first": first, "second": second,
           "first_over_second_tok_s": first["output_tok_s"] / second["output_tok_s"]}
    print(f"warmup={warmup!s:5s} ready in {ready_s:5.1f} s | first burst {first['output_tok_s']:6.1f} tok/s, TTFT "
          f"{first['median_ttft_ms']:7.1f} ms | second {second['output_tok_s']:6.1f} tok/s, TTFT "
          f"{second['median_ttft_ms']:7.1f} ms | first/second {row['first_over_second_tok_s']:.2f}x")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    rows = [measure(False, args), measure(True, args)]
    if args.save:
        args.save.write_text(json.dumps({**run_record(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
