"""Gateway overhead of several checkouts of burstgate, side by side in front of ONE upstream.

``gateway_overhead.py`` run in two checkouts also changes its upstream (the load tester's mock server is part
of the checkout), and on a 2-core machine a slower mock leaves less CPU to the gateway. Here every gateway,
each started from its own checkout (``PYTHONPATH``), relays to the same mock server, from the first checkout
given; the same client loads them in interleaved rounds, alternating their order: N requests at concurrency
C, then requests one at a time.

Throughput on a shared 2-core machine swings ±12% between rounds, which hides a few percent. ``--instructions``
also counts the instructions each gateway process executes per request (valgrind's callgrind, counting
switched on only around a burst of ``--instruction-requests`` at concurrency C): deterministic to ±1%, so a
change of a few percent shows. Needs ``valgrind`` (apt).

    git worktree add /tmp/before <commit>
    python benchmarks/gateway_versions.py before=/tmp/before head=. --save benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_overhead import load
from peers import burstgate, free_port, run_record, serving


def on(checkout: Path) -> dict:
    """The environment that runs ``checkout``'s code."""
    return {"PYTHONPATH": str(checkout.resolve())}


def instructions_per_request(checkout: Path, cfg: Path, requests: int, concurrency: int) -> float:
    """Instructions the gateway of ``checkout`` executes per request, under callgrind (warmed up first)."""
    out = Path(tempfile.mkdtemp()) / "callgrind.out"
    port = free_port()
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
           *burstgate("serve", "--config", str(cfg), "--port", str(port), "--log-level", "warning")]
    with serving(cmd, port, on(checkout)) as url:
        asyncio.run(load(url, "mock", 2 * concurrency, concurrency, {}))
        subprocess.run(["callgrind_control", "--instr=on"], check=True, capture_output=True)
        asyncio.run(load(url, "mock", requests, concurrency, {}))  # + its own 20 warm-up requests
        subprocess.run(["callgrind_control", "--instr=off"], check=True, capture_output=True)
    totals = [int(line.split()[1]) for f in out.parent.glob("callgrind.out*") for line in f.read_text().splitlines()
              if line.startswith(("summary:", "totals:"))]
    return max(totals) / (requests + min(20, requests))


def _commit(checkout: Path) -> str:
    """The checkout's commit, marked when its tree has uncommitted changes."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *cmd], capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if git("status", "--porcelain") else "")


def _checkout(text: str) -> tuple[str, Path]:
    name, _, path = text.partition("=")
    if not name or not Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=PATH, PATH a checkout of burstgate")
    return name, Path(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkouts", nargs="+", metavar="NAME=PATH", type=_checkout)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--serial-requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--instructions", action="store_true", help="also count instructions per request (valgrind)")
    ap.add_argument("--instruction-requests", type=int, default=300)
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    checkouts = dict(args.checkouts)
    rows = []
    with contextlib.ExitStack() as servers:
        port = free_port()
        mock = servers.enter_context(serving(burstgate("loadtest", "mock-server", "--port", str(port), "--model", "mock"),
                                             port, on(next(iter(checkouts.values())))))
        cfg = Path(tempfile.mkdtemp()) / "gateway.yaml"
        cfg.write_text(f"models:\n  - name: mock\n    deployments:\n      - kind: openai\n        url: {mock}/v1\n")
        urls = {}
        for name, checkout in checkouts.items():
            port = free_port()
            urls[name] = servers.enter_context(serving(burstgate("serve", "--config", str(cfg), "--port", str(port),
                                                                 "--log-level", "warning"), port, on(checkout)))
        for r in range(args.rounds):
            for name in (list(urls) if r % 2 == 0 else list(urls)[::-1]):
                elapsed, _ = asyncio.run(load(urls[name], "mock", args.requests, args.concurrency, {}))
                _, serial = asyncio.run(load(urls[name], "mock", args.serial_requests, 1, {}))
                rows.append({"checkout": name, "round": r, "rps": args.requests / elapsed,
                             "serial_p50_ms": statistics.median(serial) * 1000})
                print(f"round {r} {name:10s} c={args.concurrency}: {rows[-1]['rps']:7.1f} req/s | c=1: p50 "
                      f"{rows[-1]['serial_p50_ms']:5.2f} ms", flush=True)
        instructions = {}
        if args.instructions:  # one at a time: callgrind_control switches every callgrind process
            for name, checkout in checkouts.items():
                instructions[name] = instructions_per_request(checkout, cfg, args.instruction_requests, args.concurrency)
                print(f"{name:10s} {instructions[name] / 1e6:.3f} M instructions per request", flush=True)
    medians = {name: {"rps": statistics.median(r["rps"] for r in rows if r["checkout"] == name),
                      "serial_p50_ms": statistics.median(r["serial_p50_ms"] for r in rows if r["checkout"] == name),
                      **({"instructions_per_request": instructions[name]} if name in instructions else {})}
               for name in checkouts}
    first = next(iter(medians.values()))
    for name, m in medians.items():
        print(f"{name:10s} median {m['rps']:7.1f} req/s ({m['rps'] / first['rps']:.2f}x)  serial p50 "
              f"{m['serial_p50_ms']:.2f} ms" + (f"  instructions/request {m['instructions_per_request'] / 1e6:.3f} M "
                                               f"({m['instructions_per_request'] / first['instructions_per_request']:.3f}x)"
                                               if instructions else ""))
    if args.save:
        commits = {name: _commit(path) for name, path in checkouts.items()}
        args.save.write_text(json.dumps({**run_record(), "checkouts": commits, "rows": rows, "medians": medians},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
