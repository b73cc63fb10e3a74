"""What a gateway adds: the same instant OpenAI-compatible backend called directly, through burstgate,
and (when installed) through LiteLLM's proxy, in one run.

Each server runs in its own process on 127.0.0.1; the client sends N non-streamed completions at a
fixed concurrency, then one at a time, and prints req/s, p50/p99 latency and the ratios.

    python benchmarks/gateway_overhead.py --requests 2000 --concurrency 32
    # LiteLLM (kept out of the project's dependencies): make peers-litellm, then pass --litellm
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import PEERS, burstgate, free_port, serving

LITELLM_BIN = PEERS / "litellm" / "bin" / "litellm"


async def load(url: str, model: str, n: int, concurrency: int, headers: dict) -> tuple[float, list[float]]:
    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    body = {"model": model, "prompt": "hello world", "max_tokens": 16}
    # aiohttp: the lightest asyncio client here, so the servers, not the client, set the pace.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60),
                                     connector=aiohttp.TCPConnector(limit=concurrency * 2)) as client:
        async def one():
            async with gate:
                t = time.perf_counter()
                async with client.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                    r.raise_for_status()
                    await r.read()
                latencies.append(time.perf_counter() - t)
        for _ in range(min(20, n)):  # warm connections and code paths
            await one()
        latencies.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.perf_counter() - t0, latencies


def measure(name: str, url: str, model: str, args, headers: dict | None = None) -> dict:
    headers = headers or {}
    elapsed, lat = asyncio.run(load(url, model, args.requests, args.concurrency, headers))
    _, lat1 = asyncio.run(load(url, model, args.serial_requests, 1, headers))
    q = statistics.quantiles(lat, n=100)
    row = {"name": name, "rps": args.requests / elapsed, "p50_ms": q[49] * 1000, "p99_ms": q[98] * 1000,
           "serial_p50_ms": statistics.median(lat1) * 1000}
    print(f"{name:10s} c={args.concurrency}: {row['rps']:8.1f} req/s  p50 {row['p50_ms']:6.2f} ms  p99 "
          f"{row['p99_ms']:6.2f} ms | c=1: p50 {row['serial_p50_ms']:6.2f} ms")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--serial-requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--litellm", action="store_true", help=f"also measure LiteLLM's proxy ({LITELLM_BIN})")
    args = ap.parse_args()
    with contextlib.ExitStack() as servers:
        port = free_port()
        mock = servers.enter_context(serving(burstgate("loadtest", "mock-server", "--port", str(port), "--model", "mock"),
                                             port, timeout_s=180))
        cfg = Path(tempfile.mkdtemp()) / "gateway.yaml"
        cfg.write_text(f"models:\n  - name: mock\n    deployments:\n      - kind: openai\n        url: {mock}/v1\n")
        port = free_port()
        gw = servers.enter_context(serving(burstgate("serve", "--config", str(cfg), "--port", str(port), "--log-level",
                                                     "warning"), port, timeout_s=180))
        rows = [measure("direct", mock, "mock", args), measure("burstgate", gw, "mock", args)]
        if args.litellm:
            port = free_port()
            lcfg = cfg.parent / "litellm.yaml"
            lcfg.write_text(f"model_list:\n  - model_name: mock\n    litellm_params:\n      model: openai/mock\n"
                            f"      api_base: {mock}/v1\n      api_key: none\n")
            key = {"Authorization": "Bearer sk-bench"}
            lt = servers.enter_context(serving(
                [str(LITELLM_BIN), "--config", str(lcfg), "--port", str(port), "--host", "127.0.0.1"], port,
                {"LITELLM_MASTER_KEY": "sk-bench", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}, 180, key))
            rows.append(measure("litellm", lt, "mock", args, key))
    direct, ours = rows[0], rows[1]
    print(f"\nburstgate adds {ours['serial_p50_ms'] - direct['serial_p50_ms']:.2f} ms at p50 one at a time "
          f"(goal <= 1 ms); keeps {ours['rps'] / direct['rps']:.0%} of direct req/s at c={args.concurrency}")
    if args.litellm:
        lite = rows[2]
        print(f"burstgate / LiteLLM req/s = {ours['rps'] / lite['rps']:.2f}x (goal >= 4x); LiteLLM adds "
              f"{lite['serial_p50_ms'] - direct['serial_p50_ms']:.2f} ms at p50")

if __name__ == "__main__":
    main()
