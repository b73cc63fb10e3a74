"""One burst through each engine's own HTTP server, one client for all: throughput and latency side by side.

Workloads (``--workload``, repeatable):
  mixed: 64 requests, inputs 32-512 tokens, outputs 16-256 (issue #2's burst, as engine_vs_transformers.py);
  paper: arXiv 2311.03687's shape scaled to what a 2-core CPU finishes in minutes
         (it prefills ~300 prompt tokens/s: 200 x 512 took 6 min per server): 100 prompts x 512 tokens, 64 out.
Targets: ``burstgate serve`` with a native deployment in each ``--dtype`` (plus ``--native NAME:FIELD=VALUE,...``
variants, e.g. scheduler settings), and optionally vLLM's CPU build in the same dtypes (``--vllm``, make peers),
DeepSpeed-Inference in the same dtypes behind burstgate's deepspeed deployment (``--deepspeed``; static batches
of 32) and llama.cpp's server on the same GGUF (``--llamacpp``: llama-server, its Q4_1 weights, 16 parallel
slots). ``--kv-cache-dtype fp8`` (repeatable, with ``auto``) stores the KV cache in fp8 on native and vLLM alike
(vLLM's own flag), named ``<engine>-<dtype>+kv-fp8``.

One client drives them all: burstgate's load tester (all requests at t=0, exact input lengths through each
server's /tokenize, ignore_eos, fixed output lengths), the same request set for every target within a round,
fresh prompts each round (the round is the seed: no prefix cache carries over), rounds interleaved with the
targets' order alternating, 4 warm-up requests per target and round before the burst. Each metric is the
median over rounds; ratios are against ``--baseline`` (default: vLLM in the same dtype when measured, else native
in the same dtype, else the first target).

    python benchmarks/served_burst.py --workload mixed --workload paper --vllm --rounds 2 \\
        --save benchmarks/results/served_burst.json
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
from peers import burstgate, free_port, loadtest, run_record, serving, start_llamacpp, start_vllm

MODEL = "smollm2"
WORKLOADS = {
    "mixed": {"requests": 64, "input_len": "32:512", "output_len": "16:256"},
    "paper": {"requests": 100, "input_len": "512", "output_len": "64"},
}
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
           "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms", "duration")


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME:FIELD=VALUE,...`` -> (NAME, {FIELD: VALUE}) with VALUE read as JSON where it parses."""
    name, _, fields = text.partition(":")
    out = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return name, out


def serve_deployment(stack: contextlib.ExitStack, deployment: dict) -> str:
    """``burstgate serve`` with one model made of ``deployment``, for the life of ``stack``: its URL."""
    return serve_model(stack, [deployment])


def serve_model(stack: contextlib.ExitStack, deployments: list[dict], routing: str | None = None) -> str:
    """``burstgate serve`` of one model (MODEL) made of ``deployments`` routed by ``routing`` (default: the
    gateway's), for the life of ``stack``: its URL."""
    port, config = free_port(), Path(tempfile.mkdtemp()) / "config.json"  # JSON is YAML
    model = {"name": MODEL, "deployments": deployments, **({"routing": routing} if routing else {})}
    config.write_text(json.dumps({"models": [model]}))
    return stack.enter_context(serving(burstgate("serve", "--port", str(port), "--config", str(config),
                                                 "--log-level", "warning"), port))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    ap.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    ap.add_argument("--native", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                    help="another native target with these deployment fields (e.g. chunk512:max_num_batched_tokens=512)")
    ap.add_argument("--vllm", action="store_true", help="also vLLM's CPU build in each dtype (make peers)")
    ap.add_argument("--deepspeed", action="store_true", help="also DeepSpeed-Inference behind burstgate in each dtype")
    ap.add_argument("--llamacpp", action="store_true", help="also llama.cpp's server (make peers-llamacpp)")
    ap.add_argument("--kv-cache-dtype", action="append", choices=["auto", "fp8", "fp8_e5m2"],
                    help="KV cache storage of native and vLLM targets (repeatable; default auto)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", help="target the ratios divide by (default: vllm-<dtype>, else native-<dtype>, else the first)")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    workloads = args.workload or ["mixed"]
    dtypes = args.dtype or ["float32"]
    rows = []
    with contextlib.ExitStack() as stack:
        targets: dict[str, str] = {}
        for dtype, kv in ((d, kv) for d in dtypes for kv in args.kv_cache_dtype or ["auto"]):
            variant, kv_fields = (dtype, {}) if kv == "auto" else (f"{dtype}+kv-{kv}", {"kv_cache_dtype": kv})
            targets[f"native-{variant}"] = serve_deployment(stack, {"kind": "native", "dtype": dtype, **kv_fields})
            for name, fields in map(parse_variant, args.native):
                targets[f"{name}-{variant}"] = serve_deployment(stack, {"kind": "native", "dtype": dtype, **kv_fields,
                                                                        **fields})
            if args.vllm:
                port = free_port()
                extra = () if kv == "auto" else ("--kv-cache-dtype", kv)
                stack.callback(start_vllm(port, MODEL, dtype=dtype, extra_args=extra).terminate)
                targets[f"vllm-{variant}"] = f"http://127.0.0.1:{port}"
            if args.deepspeed and kv == "auto":
                targets[f"deepspeed-{dtype}"] = serve_deployment(stack, {"kind": "deepspeed", "dtype": dtype})
        if args.llamacpp:
            port = free_port()
            stack.callback(start_llamacpp(port, MODEL).terminate)
            targets["llama.cpp-q4_1"] = f"http://127.0.0.1:{port}"
        for r in range(args.rounds):
            for workload in workloads:
                shape = WORKLOADS[workload]
                for name in (list(targets) if r % 2 == 0 else list(targets)[::-1]):
                    result = loadtest(f"{targets[name]}#{MODEL}", Path(tempfile.mkdtemp()),
                                      "--requests", str(shape["requests"]), "--input-len", shape["input_len"],
                                      "--output-len", shape["output_len"], "--warmup", "4",
                                      "--seed", str(1000 + r), "--timeout", "1800")
                    row = {"workload": workload, "target": name, "round": r, "completed": result["completed"],
                           "failed": result["failed"], "total_input_tokens": result["total_input_tokens"],
                           "total_output_tokens": result["total_output_tokens"],
                           **{m: result[m] for m in METRICS}}
                    rows.append(row)
                    print(f"round {r} {workload:6s} {name:22s} {row['output_throughput']:7.1f} out tok/s  "
                          f"TTFT p50/p99 {row['median_ttft_ms']:8.0f} / {row['p99_ttft_ms']:8.0f} ms  "
                          f"TPOT p50/p99 {row['median_tpot_ms']:6.1f} / {row['p99_tpot_ms']:6.1f} ms  "
                          f"{row['completed']} ok, {row['failed']} failed", flush=True)
    summary = summarize(rows, workloads, list(targets), args.baseline)
    print_table(summary, args.rounds)
    if args.save:
        args.save.write_text(json.dumps({**run_record(), "workloads": {w: WORKLOADS[w] for w in workloads},
                                         "summary": summary, "rows": rows}, indent=2) + "\n")


def summarize(rows: list[dict], workloads: list[str], targets: list[str], baseline: str | None) -> dict:
    """Per workload and target: each metric's median over rounds, and its ratio to the baseline's."""
    summary: dict[str, dict] = {}
    for workload in workloads:
        medians = {}
        for name in targets:
            mine = [r for r in rows if r["workload"] == workload and r["target"] == name]
            medians[name] = {m: statistics.median(r[m] for r in mine) for m in METRICS}
            medians[name]["failed"] = sum(r["failed"] for r in mine)
        for name, values in medians.items():
            dtype = name.split("-", 1)[-1]  # the dtype, with its KV cache storage where that is not auto
            base = baseline or next((b for b in (f"vllm-{dtype}", f"native-{dtype}") if b in medians), targets[0])
            values["baseline"] = base
            values["throughput_ratio"] = values["output_throughput"] / medians[base]["output_throughput"]
            values["p99_tpot_ratio"] = values["p99_tpot_ms"] / medians[base]["p99_tpot_ms"]
            values["p99_ttft_ratio"] = values["p99_ttft_ms"] / medians[base]["p99_ttft_ms"]
        summary[workload] = medians
    return summary


def print_table(summary: dict, rounds: int) -> None:
    for workload, medians in summary.items():
        shape = WORKLOADS[workload]
        print(f"\n{workload}: {shape['requests']} requests at t=0, {shape['input_len']} in, {shape['output_len']} out; "
              f"medians of {rounds} rounds")
        print(f"{'target':22s} {'out tok/s':>9s} {'ratio':>6s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p50':>9s} "
              f"{'TPOT p99':>9s} {'p99 TPOT ratio':>15s}  vs")
        for name, v in medians.items():
            print(f"{name:22s} {v['output_throughput']:9.1f} {v['throughput_ratio']:6.2f} {v['median_ttft_ms']:9.0f} "
                  f"{v['p99_ttft_ms']:9.0f} {v['median_tpot_ms']:9.1f} {v['p99_tpot_ms']:9.1f} "
                  f"{v['p99_tpot_ratio']:15.2f}  {v['baseline']}")


if __name__ == "__main__":
    main()
