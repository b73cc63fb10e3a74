"""How long a burst takes to leave the client: ``vllm bench serve``'s way of timing it against the wire.

vllm bench records each request's start (``st``) before ``session.post``, on a session with ``trust_env=True``,
where aiohttp first hands the netrc and proxy lookups to a thread pool: every task takes its timestamp, then
waits for the pool, and the burst's requests go out after all the timestamps were taken. Its "start times" then
spread less than the requests really do. This measures, in one process against the instant mock server
(``burstgate loadtest mock-server``), a burst of ``--requests`` streamed completions after one warm-up request (as
vllm bench's initial test run), sent the way vllm bench sends them, with ``trust_env`` off (burstgate's client)
and on (vllm bench's): the spread of the recorded start times and of the moments each request's headers were
written to its connection (aiohttp's ``on_request_headers_sent`` trace), medians over rounds, alternating.

    python benchmarks/burst_send_spread.py --rounds 5 --save benchmarks/results/burst_send_spread.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import burstgate, free_port, run_record, serving

PROMPT = "hello " * 256


async def burst(url: str, n: int, trust_env: bool) -> dict[str, float]:
    """One warm-up request, then ``n`` at once: the spread (ms) of the recorded starts and of the headers sent."""
    sent: list[float] = []

    async def on_headers_sent(session, context, params) -> None:
        sent.append(time.perf_counter())

    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(on_headers_sent)
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)  # vllm bench's
    async with aiohttp.ClientSession(connector=connector, trust_env=trust_env, trace_configs=[trace],
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:
        starts: list[float] = []

        async def one() -> None:
            payload = {"model": "mock", "prompt": PROMPT, "max_tokens": 16, "stream": True, "ignore_eos": True}
            starts.append(time.perf_counter())  # where vllm bench takes its start time
            async with session.post(url + "/v1/completions", json=payload) as response:
                async for _ in response.content:
                    pass

        await one()
        starts.clear()
        sent.clear()
        await asyncio.gather(*(asyncio.create_task(one()) for _ in range(n)))
    return {"recorded_start_spread_ms": (max(starts) - min(starts)) * 1000,
            "headers_sent_spread_ms": (max(sent) - min(sent)) * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    runs = []
    port = free_port()
    with serving(burstgate("loadtest", "mock-server", "--port", str(port)), port) as url:
        for r in range(args.rounds):
            for trust_env in ((False, True) if r % 2 == 0 else (True, False)):
                row = {"round": r, "trust_env": trust_env, **asyncio.run(burst(url, args.requests, trust_env))}
                runs.append(row)
                print(f"round {r} trust_env={trust_env!s:5}  recorded starts over {row['recorded_start_spread_ms']:5.1f} ms"
                      f"  headers sent over {row['headers_sent_spread_ms']:5.1f} ms", flush=True)
    table = []
    for trust_env in (False, True):
        rows = [x for x in runs if x["trust_env"] is trust_env]
        table.append(f"trust_env={trust_env}: recorded starts {statistics.median(x['recorded_start_spread_ms'] for x in rows):.1f} ms, "
                     f"headers sent {statistics.median(x['headers_sent_spread_ms'] for x in rows):.1f} ms (medians)")
    print("\n".join(table))
    if args.save:
        args.save.write_text(json.dumps({**run_record(), "requests": args.requests, "runs": runs, "table": table},
                                        indent=2))


if __name__ == "__main__":
    main()
