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

With ``--count-reads`` each client also counts the reads its stream loop takes (aiohttp's ``iter_any``, which
both use), so the figure splits into reads per streamed token and CPU per read: against the instant server the
number of events a read carries depends on how fast the client comes back for the next read, not on the
server.
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
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from loadtest_agreement import VLLM_BENCH
from peers import HF_DIR, VLLM_PYTHON, burstgate, export_hf_dir, free_port, run_record, serving

MODEL = "mock"
BURSTGATE = "import sys; from gateway.cli import app; sys.argv[0] = 'burstgate'; app()"  # what its console script runs
# Put before a client's program: counts the reads of aiohttp's stream iterators (iter_any, which both clients'
# loops use) and writes the count at exit to the file CLIENT_CPU_READS names. The count costs each read ~1 us of
# its own, included in the CPU measured.
COUNT_READS = ("import atexit, os, aiohttp.streams as _s; _reads = [0]; _next = _s.AsyncStreamIterator.__anext__\n"
               "async def _counted(self):\n    chunk = await _next(self); _reads[0] += 1; return chunk\n"
               "_s.AsyncStreamIterator.__anext__ = _counted\n"
               "def _write():\n    if path := os.environ.get('CLIENT_CPU_READS'):\n"
               "        with open(path, 'w') as f: f.write(str(_reads[0]))\n"
               "atexit.register(_write)\n")


@dataclass
class Cost:
    """What one client run took: CPU seconds (user + system) and stream reads (None when not counted)."""

    cpu_s: float
    reads: int | None


def run_client(cmd: list[str], checkout: Path | None = None) -> Cost:
    """Runs ``cmd`` start to exit (with ``checkout``'s packages first on the path) and says what it took."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    descriptor, name = tempfile.mkstemp()
    os.close(descriptor)
    reads_file = Path(name)
    path = {"PYTHONPATH": str(checkout)} if checkout else {}
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=checkout,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                            "CLIENT_CPU_READS": str(reads_file), **path})
        counted = reads_file.read_text()
    finally:
        reads_file.unlink()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return Cost((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
                int(counted) if counted else None)


def ours(url: str, streams: int, tokens: int, preamble: str = "") -> list[str]:
    out = Path(tempfile.mkdtemp())
    return [sys.executable, "-c", preamble + BURSTGATE, "loadtest", "run", "--target", f"{url}#{MODEL}",
            "--requests", str(streams), "--input-len", "16", "--output-len", str(tokens), "--warmup", "0",
            "--no-plots", "--out", str(out), "--db", str(out / "store.sqlite")]


def vllm_bench(url: str, streams: int, tokens: int, preamble: str = "") -> list[str]:
    out = Path(tempfile.mkdtemp())
    return [str(VLLM_PYTHON), "-c", preamble + VLLM_BENCH, "--backend", "openai", "--base-url", url, "--endpoint",
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
    ap.add_argument("--count-reads", action="store_true", help="also count each client's stream reads: reads per "
                    "streamed token and CPU per read")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    export_hf_dir()
    tools = {"burstgate": ours, "vllm bench": vllm_bench}
    if args.before:
        tools["burstgate (before)"] = ours
    preamble = COUNT_READS if args.count_reads else ""
    per_token: dict[str, list[float]] = {name: [] for name in tools}
    reads_per_token: dict[str, list[float]] = {name: [] for name in tools}
    per_read: dict[str, list[float]] = {name: [] for name in tools}
    reads_counted: dict[str, list[tuple[int, int]]] = {name: [] for name in tools}  # (short run's, long run's)
    tokens = args.streams * (args.long - args.short)
    port = free_port()
    mock = burstgate("loadtest", "mock-server", "--port", str(port), "--model", MODEL, "--itl-ms", str(args.itl_ms))
    with serving(mock, port) as url:
        for r in range(args.rounds):
            for name in (list(tools) if r % 2 == 0 else list(tools)[::-1]):
                checkout = args.before if name == "burstgate (before)" else None
                short = run_client(tools[name](url, args.streams, args.short, preamble), checkout)
                long = run_client(tools[name](url, args.streams, args.long, preamble), checkout)
                cpu_s = long.cpu_s - short.cpu_s
                per_token[name].append(cpu_s / tokens * 1e6)
                line = (f"round {r} {name:18s} {short.cpu_s:6.2f} s / {long.cpu_s:6.2f} s CPU: "
                        f"{per_token[name][-1]:5.1f} us per streamed token")
                if long.reads is not None and short.reads is not None:
                    reads = long.reads - short.reads
                    reads_counted[name].append((short.reads, long.reads))
                    reads_per_token[name].append(reads / tokens)
                    line += f", {reads} more reads ({short.reads} / {long.reads}): {reads / tokens:.2f} a token"
                    # a client that fell behind the stream can take fewer reads for more tokens: no CPU per read
                    if reads > 0:
                        per_read[name].append(cpu_s / reads * 1e6)
                        line += f", {per_read[name][-1]:5.1f} us a read"
                print(line, flush=True)
    medians = {name: statistics.median(v) for name, v in per_token.items()}
    ratio = medians["burstgate"] / medians["vllm bench"]
    print(f"median CPU per streamed token: burstgate {medians['burstgate']:.1f} us, vllm bench "
          f"{medians['vllm bench']:.1f} us: {ratio:.2f}x")
    counted = {}
    if args.count_reads:
        counted = {"reads": reads_counted, "reads_per_token": reads_per_token, "us_per_read": per_read,
                   "median_reads_per_token": {name: statistics.median(v) for name, v in reads_per_token.items()},
                   "median_us_per_read": {name: statistics.median(v) if v else None for name, v in per_read.items()}}
        for name in tools:
            us = counted["median_us_per_read"][name]
            print(f"{name}: {counted['median_reads_per_token'][name]:.2f} reads a streamed token, "
                  + (f"{us:.1f} us CPU a read (medians)" if us is not None else "no round with more reads"))
    if args.before:
        print(f"burstgate before: {medians['burstgate (before)']:.1f} us "
              f"({medians['burstgate (before)'] / medians['vllm bench']:.2f}x vllm bench)")
    if args.save:
        args.save.write_text(json.dumps({**run_record(), "before": str(args.before) if args.before else None,
                                         "itl_ms": args.itl_ms, "streams": args.streams, "short": args.short,
                                         "long": args.long, "us_per_token": per_token, "median_us": medians,
                                         "burstgate_over_vllm_bench": ratio, **counted}, indent=2) + "\n")


if __name__ == "__main__":
    main()
