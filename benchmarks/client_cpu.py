"""CPU the load-testing client spends per streamed token: burstgate's tester against ``vllm bench serve``.

Both clients stream the same burst (``--streams`` requests at t=0, ignore_eos, 16-token prompts) from the instant
mock server (``burstgate loadtest mock-server``, its own process), once with ``--short`` and once with ``--long``
output tokens per stream. A client's CPU per streamed token is the difference of its process's CPU time (user +
system, from ``getrusage(RUSAGE_CHILDREN)``) between the two runs over the difference in tokens: start-up, imports,
tokenizer loading and prompt building are the same in both and cancel. Rounds interleave the tools; the median is
reported, and ours over vLLM's as a ratio. burstgate runs with ``--no-plots`` (plots are drawn after the run) and
keeps every request's timings (its store, requests-*.jsonl, vLLM-schema files), so vLLM's bench runs with
``--save-result --save-detailed``, which keeps its per-request timings too, and with its progress bar, as
burstgate's shows its own.

    make peers   # vllm bench's client comes from vLLM's venv
    git worktree add /tmp/before <older commit>   # optional: the tester as it was, beside today's
    python benchmarks/client_cpu.py --streams 256 --long 4096 --rounds 3 --before /tmp/before \
        --save benchmarks/results/client_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from loadtest_agreement import VLLM_BENCH
from peers import HF_DIR, VLLM_PYTHON, burstgate, export_hf_dir, free_port, run_record, serving

MODEL = "mock"


def cpu_seconds(cmd: list[str], checkout: Path | None = None) -> float:
    """The CPU time (user + system) ``cmd`` takes, start to exit (with ``checkout``'s packages first on the path)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    path = {"PYTHONPATH": str(checkout)} if checkout else {}
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=checkout,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **path})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def ours(url: str, streams: int, tokens: int, module: bool = False) -> list[str]:
    out = Path(tempfile.mkdtemp())
    cli = [sys.executable, "-m", "gateway.cli"] if module else burstgate()
    return cli + ["loadtest", "run", "--target", f"{url}#{MODEL}", "--requests", str(streams), "--input-len", "16",
                     "--output-len", str(tokens), "--warmup", "0", "--no-plots", "--out", str(out), "--db",
                     str(out / "store.sqlite")]


def vllm_bench(url: str, streams: int, tokens: int) -> list[str]:
    out = Path(tempfile.mkdtemp())
    return [str(VLLM_PYTHON), "-c", VLLM_BENCH, "--backend", "openai", "--base-url", url, "--endpoint",
            "/v1/completions", "--model", MODEL, "--tokenizer", str(HF_DIR), "--dataset-name", "random",
            "--random-input-len", "16", "--random-output-len", str(tokens), "--num-prompts", str(streams),
            "--ignore-eos", "--save-result", "--save-detailed", "--result-dir", str(out),
            "--result-filename", "r.json"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--short", type=int, default=128)
    ap.add_argument("--long", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--itl-ms", type=float, default=0.0, help="the mock server's gap between tokens: paced, every "
                    "event arrives in a read of its own for both clients (default: instant)")
    ap.add_argument("--before", type=Path, metavar="CHECKOUT", help="also the tester of another checkout (e.g. a "
                    "`git worktree` of an older commit), as `burstgate (before)`")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    export_hf_dir()
    tools = {"burstgate": ours, "vllm bench": vllm_bench}
    if args.before:
        tools["burstgate (before)"] = lambda url, n, tokens: ours(url, n, tokens, module=True)
    per_token: dict[str, list[float]] = {name: [] for name in tools}
    port = free_port()
    mock = burstgate("loadtest", "mock-server", "--port", str(port), "--model", MODEL, "--itl-ms", str(args.itl_ms))
    with serving(mock, port) as url:
        for r in range(args.rounds):
            for name in (list(tools) if r % 2 == 0 else list(tools)[::-1]):
                checkout = args.before if name == "burstgate (before)" else None
                short = cpu_seconds(tools[name](url, args.streams, args.short), checkout)
                long = cpu_seconds(tools[name](url, args.streams, args.long), checkout)
                us = (long - short) / (args.streams * (args.long - args.short)) * 1e6
                per_token[name].append(us)
                print(f"round {r} {name:18s} {short:6.2f} s / {long:6.2f} s CPU: {us:5.1f} us per streamed token",
                      flush=True)
    medians = {name: statistics.median(v) for name, v in per_token.items()}
    ratio = medians["burstgate"] / medians["vllm bench"]
    print(f"median CPU per streamed token: burstgate {medians['burstgate']:.1f} us, vllm bench "
          f"{medians['vllm bench']:.1f} us: {ratio:.2f}x")
    if args.before:
        print(f"burstgate before: {medians['burstgate (before)']:.1f} us "
              f"({medians['burstgate (before)'] / medians['vllm bench']:.2f}x vllm bench)")
    if args.save:
        args.save.write_text(json.dumps({**run_record(), "before": str(args.before) if args.before else None, "itl_ms": args.itl_ms,
                                         "streams": args.streams, "short": args.short,
                                         "long": args.long, "us_per_token": per_token, "median_us": medians,
                                         "burstgate_over_vllm_bench": ratio}, indent=2) + "\n")


if __name__ == "__main__":
    main()
