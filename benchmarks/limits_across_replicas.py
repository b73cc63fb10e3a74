"""Rate limits across gateway replicas at their real size: minute windows, two ``burstgate serve`` processes sharing
one redis-server in front of the mock upstream, both keys driven at twice their limits for several minutes, and
Redis killed halfway through one window and started again (empty) halfway through the next.

Per window: requests admitted for the "req" key (limit: --requests), tokens Redis charged the "tok" key (limit:
--tokens; requests of 3 prompt tokens and 3 output tokens, a third streamed, half of those abandoned after their
first chunk) and requests admitted for it; and the tokens the gateways' metrics counted for it over the run.
The test of the same (tests/gateway/test_limits_across_replicas.py) runs 3-second windows.

    python benchmarks/limits_across_replicas.py --save benchmarks/results/limits_across_replicas.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import run_record

from tests.gateway.test_limits_across_replicas import (
    TOKEN_BODY,
    admitted,
    counted_tokens,
    drive,
    fleet,
    read_windows,
    redis_on,
    window_of,
)
from tests.servers import free_port


async def run(urls: list[str], redis_port: int, stack: contextlib.ExitStack, args) -> dict:
    w = args.window_s
    charged: dict[int, int | None] = {}
    plain = {"model": "plain", "prompt": "Hi", "max_tokens": 2}
    loads = asyncio.gather(drive(urls, "k-req", 2 * args.requests / w, args.windows, plain, window_s=w),
                           drive(urls, "k-tok", 2 * args.tokens / 6 / w, args.windows, TOKEN_BODY, stream_every=3,
                                 window_s=w),
                           read_windows(redis.asyncio.Redis(port=redis_port), args.windows, charged, w))
    start = (window_of(time.time(), w) + 1) * w
    await asyncio.sleep(start + (args.outage_window + 0.5) * w - time.time())
    stack.close()  # Redis killed
    killed = time.time()
    await asyncio.sleep(start + (args.outage_window + 1.5) * w - time.time())
    stack.enter_context(redis_on(redis_port))  # back, empty
    back = time.time()
    requests, tokens, _ = await loads
    windows = sorted(charged)
    req, tok = admitted(requests), admitted(tokens)
    return {"windows": [{"window": k, "redis": "killed" if k == args.outage_window else
                         "returned" if k == args.outage_window + 1 else "up",
                         "req_admitted": req[wid], "req_limit": args.requests,
                         "tok_admitted_requests": tok[wid], "tok_charged": charged[wid], "tok_limit": args.tokens}
                        for k, wid in enumerate(windows)],
            "redis_killed_s": round(killed - start, 1), "redis_back_s": round(back - start, 1),
            "tok_charged_total_redis_up": sum(c for k, c in enumerate(charged[x] for x in windows)
                                              if k < args.outage_window and c is not None),
            "tok_sent": len(tokens), "req_sent": len(requests)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--requests", type=int, default=600, help="the req key's limit per window")
    ap.add_argument("--tokens", type=int, default=6000, help="the tok key's limit per window")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--outage-window", type=int, default=2, help="Redis dies halfway through this window (from 0)")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    redis_port = free_port()
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as redis_stack:
        redis_stack.enter_context(redis_on(redis_port))
        with fleet(Path(folder), redis_port, args.requests, args.tokens, args.window_s) as urls:
            result = asyncio.run(run(urls, redis_port, redis_stack, args))
            result["tok_counted_by_gateways"] = counted_tokens(urls)
    record = {**run_record(), "result": result}
    for row in result["windows"]:
        print(f"window {row['window']} (Redis {row['redis']:>8}): req admitted {row['req_admitted']:>5} of "
              f"{row['req_limit']}  tok charged {row['tok_charged']} of {row['tok_limit']} "
              f"({row['tok_admitted_requests']} requests)")
    if args.save:
        args.save.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
