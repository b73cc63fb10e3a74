"""Single-stream decode through each engine's HTTP server, against this machine's memory roofline.

Targets: burstgate serve on the embedded SmolLM2 (its default dtype, and with ``quantization: int8``; with
``--one-thread`` both again with ``num_threads: 1``, leaving a core to the server's event loop),
optionally llama.cpp's server on the same GGUF file (``--llamacpp``: llama-server, its own Q4_1 weights as stored) and
vLLM's CPU build (``--vllm``, fp32). One client drives them all: burstgate's load tester, one request at
a time (``--concurrency 1``), the same prompts for every target within a round, fresh prompts each round
(the round is the seed), rounds interleaved with the targets' order alternating, one warm-up request each.

Decode speed is 1000 / median TPOT. The roofline: a decoded token reads every weight once (all linear
layers and the LM head; one row of the embedding table) plus the KV cache of its context (the mean
context of a request: input + output / 2); this machine's copy bandwidth (read + write bytes per second
of a 1 GiB tensor copy, measured in the same run) bounds how fast those bytes can come, so
``roofline_fraction`` = bytes per token x decode tok/s / copy bandwidth.

    python benchmarks/single_stream.py --llamacpp --vllm --one-thread --save benchmarks/results/single_stream.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import burstgate, free_port, loadtest, run_record, serving, start_llamacpp, start_vllm

from backends.native.weights import default_model_path, open_checkpoint

MODEL = "smollm2"


def copy_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes read + written per second copying a ``gib`` GiB tensor (best of ``repeats``)."""
    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def native_bytes_per_token(url: str, context: float) -> float:
    """Bytes a decode step of one sequence reads on a burstgate server (from its GET /info)."""
    (model,) = httpx.get(f"{url}/info", timeout=10).json()["models"]
    engine = model["deployments"][0]["engine"]
    cfg = open_checkpoint(default_model_path()).config
    table = cfg.vocab_size * cfg.hidden_size * torch.finfo(getattr(torch, engine["dtype"])).bits // 8
    kv_per_token = engine["kv_cache_bytes"] / (engine["num_blocks"] * engine["block_size"])
    # The table is looked up, not streamed; of a weight held twice (its tile copy), a step reads one copy.
    return engine["weight_bytes"] - engine["small_step_copy_bytes"] - table + kv_per_token * context


def llamacpp_bytes_per_token(context: float) -> float:
    """llama.cpp reads its whole GGUF per token (the tied LM head is the embedding table) plus an f16 KV cache."""
    cfg = open_checkpoint(default_model_path()).config
    return default_model_path().stat().st_size + 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llamacpp", action="store_true", help="also llama.cpp's server (make peers-llamacpp)")
    ap.add_argument("--vllm", action="store_true", help="also vLLM's CPU build, fp32 (make peers)")
    ap.add_argument("--one-thread", action="store_true",
                    help="also both native servers with num_threads: 1 (a core left to the event loop)")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    context = args.input_len + args.output_len / 2
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)", flush=True)
    rows = []
    with contextlib.ExitStack() as stack:
        targets = {}  # name -> (url, bytes per token)
        natives = {"native": {}, "native-int8": {"quantization": "int8"}}
        if args.one_thread:
            natives |= {f"{name}-1-thread": {**fields, "num_threads": 1} for name, fields in natives.items()}
        for name, fields in natives.items():
            port, config = free_port(), Path(tempfile.mkdtemp()) / "config.json"  # JSON is YAML
            config.write_text(json.dumps({"models": [{"name": MODEL, "deployments": [{"kind": "native", **fields}]}]}))
            url = stack.enter_context(serving(burstgate("serve", "--port", str(port), "--config", str(config),
                                                        "--log-level", "warning"), port))
            targets[name] = url, native_bytes_per_token(url, context)
        if args.llamacpp:
            port = free_port()
            stack.callback(start_llamacpp(port, MODEL).terminate)
            targets["llama.cpp"] = f"http://127.0.0.1:{port}", llamacpp_bytes_per_token(context)
        if args.vllm:
            port = free_port()
            stack.callback(start_vllm(port, MODEL).terminate)
            targets["vllm"] = f"http://127.0.0.1:{port}", None
        for r in range(args.rounds):
            for name in (list(targets) if r % 2 == 0 else list(targets)[::-1]):
                url, per_token = targets[name]
                result = loadtest(f"{url}#{MODEL}", Path(tempfile.mkdtemp()), "--requests", str(args.requests),
                                  "--concurrency", "1", "--input-len", str(args.input_len), "--output-len",
                                  str(args.output_len), "--warmup", "1", "--seed", str(1000 + r))
                tok_s = 1000 / result["median_tpot_ms"]
                rows.append({"target": name, "round": r, "decode_tok_s": tok_s, "median_tpot_ms": result["median_tpot_ms"],
                             "median_ttft_ms": result["median_ttft_ms"], "completed": result["completed"],
                             "failed": result["failed"], "total_output_tokens": result["total_output_tokens"],
                             "bytes_per_token": per_token,
                             "roofline_fraction": per_token * tok_s / bandwidth if per_token else None})
                print(f"round {r} {name:12s} {tok_s:6.1f} tok/s decode (TPOT {result['median_tpot_ms']:6.2f} ms, "
                      f"TTFT {result['median_ttft_ms']:7.1f} ms, {result['completed']} ok)", flush=True)
    summary = {}
    for name in targets:
        mine = [r for r in rows if r["target"] == name]
        tok_s = statistics.median(r["decode_tok_s"] for r in mine)
        per_token = mine[0]["bytes_per_token"]
        summary[name] = {"decode_tok_s": tok_s, "bytes_per_token": per_token,
                         "roofline_tok_s": bandwidth / per_token if per_token else None,
                         "roofline_fraction": per_token * tok_s / bandwidth if per_token else None}
    first = summary["native"]["decode_tok_s"]
    print(f"\nsingle stream, {args.input_len} in / {args.output_len} out, medians of {args.rounds} rounds; copy "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s")
    for name, s in summary.items():
        roof = (f"{s['bytes_per_token'] / 1e6:7.1f} MB/token, roofline {s['roofline_tok_s']:6.1f} tok/s, "
                f"{s['roofline_fraction']:.0%} of it" if s["bytes_per_token"] else "")
        print(f"{name:12s} {s['decode_tok_s']:6.1f} tok/s ({s['decode_tok_s'] / first:.2f}x native)  {roof}")
    if args.save:
        args.save.write_text(json.dumps({**run_record(), "copy_bandwidth_bytes_s": bandwidth, "summary": summary,
                                         "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
