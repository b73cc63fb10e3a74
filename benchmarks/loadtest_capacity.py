"""How fast can the load tester itself send? Against the instant mock server, the highest constant
request rate at which burstgate's tester keeps its p99 send lag within 2 ms, with 1 and more client
worker processes.

    python benchmarks/loadtest_capacity.py --rates 100,200,400,800,1600 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import free_port  # noqa: E402

from loadtest.client import Target  # noqa: E402
from loadtest.runner import RunConfig, run_target  # noqa: E402
from loadtest.schedule import Schedule  # noqa: E402
from loadtest.workload import RequestSpec  # noqa: E402

LAG_LIMIT_MS = 2.0


def main() -> None:
    import subprocess

    from peers import wait_ready

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="100,200,400,800,1600")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--output-len", type=int, default=8)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(Path(sys.executable).parent / "burstgate"), "loadtest", "mock-server",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, 60, server)
        for workers in (int(w) for w in args.workers.split(",")):
            best = 0.0
            for rate in (float(r) for r in args.rates.split(",")):
                n = int(rate * args.seconds)
                specs = [RequestSpec("hello world", 2, args.output_len)] * n
                cfg = RunConfig(schedule=Schedule.constant, rate=rate, workers=workers)
                s = asyncio.run(run_target(Target(url, "mock"), specs, cfg)).summary
                ok = s["p99_send_lag_ms"] <= LAG_LIMIT_MS and s["failed"] == 0
                print(f"workers={workers} rate={rate:7.0f}/s: p99 send lag {s['p99_send_lag_ms']:7.2f} ms, "
                      f"achieved {s['request_throughput']:7.1f} req/s, failed {s['failed']}  {'ok' if ok else 'FALLS BEHIND'}")
                if ok:
                    best = rate
            print(f"workers={workers}: capacity {best:.0f} req/s with p99 send lag <= {LAG_LIMIT_MS} ms\n")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
