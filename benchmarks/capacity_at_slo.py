"""Capacity at an SLO, native engine against real vLLM, and the seed's charts against concurrency.

Both through their own HTTP servers on this machine, driven by one client (``burstgate loadtest run``) with the
same workload and the same SLOs:

1. ``--capacity``: per target, a synchronous point, a burst, then constant rates bisected until the first failing
   rate is within ``--precision`` of the highest passing one (a rate passes when 90% of its requests meet every
   SLO); then ``loadtest recommend`` ranks them. Each probe gets fresh prompts.
2. ``--sweep-concurrency``: each target at closed-loop concurrencies, sampling the server's CPU and memory
   (psutil, the process tree listening on its port) and its KV-cache usage gauge (from /metrics); the report's
   ``*_vs_concurrency.png`` figures are copied next to the result file. DeepSpeed-Inference (CPU, behind burstgate's
   deepspeed deployment, static batches) is the third line with ``--deepspeed``.

Client and servers share this machine's cores, unpinned, as an ops user would run it; warm-up 2 requests per
point. Targets run one after another (never at once).

    make peers   # vLLM's CPU build in .peers/vllm
    python benchmarks/capacity_at_slo.py --deepspeed --save benchmarks/results/capacity_at_slo.json
    python benchmarks/capacity_at_slo.py --users 8 --skip sweep --save benchmarks/results/capacity_at_slo_multi_turn.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import burstgate, free_port, run_record, start_vllm
from served_burst import MODEL, serve_deployment

from gateway.info import describe, devices


def run(targets: dict[str, str], out: Path, *options: str) -> Path:
    """One ``loadtest run`` over every target (hardware declared as this machine's, so vLLM ranks beside
    burstgate); its run folder."""
    hardware = describe(devices())
    specs = [a for name, url in targets.items() for a in ("--target", f"{name}={url}#{MODEL}@{hardware}")]
    cmd = burstgate("loadtest", "run", *specs, *options, "--out", str(out / "runs"), "--db", str(out / "store.sqlite"))
    subprocess.run(cmd, check=True)
    return max((out / "runs").iterdir())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24, help="requests per point and probe")
    ap.add_argument("--input-len", default="256")
    ap.add_argument("--output-len", default="32")
    ap.add_argument("--slo", action="append", default=None, metavar="KEY:MS", help="default ttft:1000, tpot:100")
    ap.add_argument("--precision", default="0.1")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--deepspeed", action="store_true", help="also DeepSpeed-Inference in the concurrency sweep")
    ap.add_argument("--skip", action="append", default=[], choices=["capacity", "sweep"])
    ap.add_argument("--users", type=int, default=0, help="multi-turn chat instead: this many conversations per "
                    "point and probe (the capacity then in conversations/s)")
    ap.add_argument("--turns", default="3")
    ap.add_argument("--system-prompt-len", default="128")
    ap.add_argument("--question-len", default="32")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    slos = args.slo or ["ttft:1000", "tpot:100"]
    if args.users:
        shape = ["--endpoint", "chat", "--users", str(args.users), "--turns", args.turns, "--system-prompt-len",
                 args.system_prompt_len, "--question-len", args.question_len]
    else:
        shape = ["--requests", str(args.requests), "--input-len", args.input_len]
    shape += ["--output-len", args.output_len, "--warmup", "2", "--timeout", "1800"]
    work = Path(tempfile.mkdtemp(prefix="capacity-"))
    earlier = json.loads(args.save.read_text()) if args.save and args.save.exists() else {}
    record: dict = {**{k: earlier[k] for k in ("capacity", "sweep") if k in earlier and k in args.skip},
                    "workload": {"users": args.users, "turns": args.turns, "system_prompt_len": args.system_prompt_len,
                                 "question_len": args.question_len, "output_len": args.output_len} if args.users
                    else {"requests": args.requests, "input_len": args.input_len, "output_len": args.output_len},
                    "slos": slos}
    with contextlib.ExitStack() as stack:
        targets = {"native": serve_deployment(stack, {"kind": "native", "dtype": "float32"})}  # as vLLM: like with like
        port = free_port()
        stack.callback(start_vllm(port, MODEL).terminate)
        targets["vllm"] = f"http://127.0.0.1:{port}"
        if "capacity" not in args.skip:
            folder = run(targets, work / "capacity", *shape, "--capacity", *(a for s in slos for a in ("--goodput", s)),
                         "--precision", args.precision, "--no-plots")
            ranked = subprocess.run(burstgate("loadtest", "recommend", "--db", str(work / "capacity" / "store.sqlite"),
                                              "--json"), check=True, capture_output=True, text=True).stdout
            record["capacity"] = {"run": run_record(), "recommendation": json.loads(ranked), "points": points(folder)}
        if "sweep" not in args.skip:
            if args.deepspeed:
                targets["deepspeed"] = serve_deployment(stack, {"kind": "deepspeed", "dtype": "float32"})
            folder = run(targets, work / "sweep", *shape, "--sweep-concurrency", args.concurrency)
            record["sweep"] = {"run": run_record(), "targets": list(targets), "points": points(folder)}
            if args.save:
                figures = args.save.with_suffix("")
                figures.mkdir(parents=True, exist_ok=True)
                for png in folder.glob("*_vs_concurrency.png"):
                    shutil.copy(png, figures / png.name)
                record["sweep"]["figures"] = sorted(str(p) for p in figures.glob("*.png"))
    _print(record)
    if args.save:
        args.save.write_text(json.dumps(record, indent=2) + "\n")


POINT_KEYS = ("label", "point", "completed", "failed", "request_throughput", "output_throughput", "median_ttft_ms",
              "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "request_goodput",
              "completed_conversations", "conversation_throughput")


def points(folder: Path) -> list[dict]:
    """Each measurement's numbers, and its server samples' peaks, from the run's files."""
    points = []
    for i, summary in enumerate(json.loads((folder / "summary.json").read_text())):
        samples = json.loads((folder / f"details-{i}.json").read_text())["samples"]
        rss = [s["rss_bytes"] for s in samples if s.get("rss_bytes")]
        cpu = [s["cpu_percent"] for s in samples if s.get("cpu_percent") is not None]
        kv = [s["kv_cache_usage"] for s in samples if s.get("kv_cache_usage") is not None]
        gpu = [sum(s["gpu_memory_used"]) for s in samples if s.get("gpu_memory_used")]
        points.append({k: summary.get(k) for k in POINT_KEYS} | {
            "samples": len(samples), "server_rss_peak_gib": max(rss) / 2**30 if rss else None,
            "server_cpu_mean_percent": sum(cpu) / len(cpu) if cpu else None,
            "kv_cache_usage_peak": max(kv) if kv else None, "gpu_memory_peak_gib": max(gpu) / 2**30 if gpu else None})
    return points


def _print(record: dict) -> None:
    for r in record.get("capacity", {}).get("recommendation", []):
        up = r["runner_up"]
        unit = r["best"]["unit"]
        print(f"capacity at {r['slos']}: {r['best']['label']} {r['best']['rate']:.2f} {unit} ({r['best']['limited_by']})"
              + (f", runner-up {up['label']} {up['rate']:.2f} {unit}, margin {r['margin']:+.0%}" if up else ""))
    for p in record.get("sweep", {}).get("points", []):
        print(f"{p['label'] + p['point']:70s} {p['output_throughput']:7.1f} tok/s  TPOT p50 {p['median_tpot_ms']:6.1f} ms"
              f"  RSS {p['server_rss_peak_gib'] or 0:.2f} GiB  CPU {p['server_cpu_mean_percent'] or 0:.0f}%"
              f"  KV {p['kv_cache_usage_peak'] if p['kv_cache_usage_peak'] is not None else '-'}")


if __name__ == "__main__":
    main()
