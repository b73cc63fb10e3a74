"""The soak: many requests, streamed, folded and abandoned at random points, then a check that the server
is back where it was. Its figures come from the server's own /metrics (process memory and descriptors,
asyncio tasks, the engine's queues and KV cache), so it measures a server in any process.

``make soak`` runs 10,000 requests against ``burstgate serve`` with no config (the embedded default); the
suite runs a short one (tests/gateway/test_soak.py).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

KINDS = ("folded", "streamed", "streamed_abandoned", "folded_abandoned")


@dataclass
class Snapshot:
    rss_bytes: float
    open_fds: float
    asyncio_tasks: float
    running: float
    waiting: float
    kv_usage: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def snapshot(url: str) -> Snapshot:
    """The server's figures now, from its /metrics (engine figures summed over its engines)."""
    values: Counter[str] = Counter()
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            values[sample.name] += sample.value
    return Snapshot(values["process_resident_memory_bytes"], values["process_open_fds"],
                    values["burstgate:asyncio_tasks"], values["burstgate:num_requests_running"],
                    values["burstgate:num_requests_waiting"], values["burstgate:kv_cache_usage_perc"])


def settled(url: str, baseline: Snapshot, timeout_s: float = 30.0) -> Snapshot:
    """The first snapshot with the engine idle and descriptors and tasks back to ``baseline`` (or the
    last one after ``timeout_s``): aborts land at the next engine step, sockets close a moment later."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = snapshot(url)
        back = (now.running == now.waiting == 0 and now.kv_usage <= baseline.kv_usage
                and now.open_fds <= baseline.open_fds and now.asyncio_tasks <= baseline.asyncio_tasks)
        if back or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


async def _one(client: httpx.AsyncClient, model: str, kind: str, rng: random.Random) -> str:
    chat = rng.random() < 0.5
    body = {"model": model, "max_tokens": rng.randint(1, 8), "temperature": rng.choice([0, 0.8]),
            "stream": kind.startswith("streamed"), **(
                {"messages": [{"role": "user", "content": f"Question {rng.randint(0, 999)}?"}]} if chat
                else {"prompt": f"Story {rng.randint(0, 999)}:"})}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if kind == "folded":
        r = await client.post(path, json=body)
        return str(r.status_code)
    if kind == "folded_abandoned":  # hung up at a random moment, often before the first token
        task = asyncio.ensure_future(client.post(path, json=body))
        await asyncio.sleep(rng.uniform(0, 0.05))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return "abandoned"
    events_wanted = rng.randint(1, 4) if kind == "streamed_abandoned" else None
    async with client.stream("POST", path, json=body) as r:
        lines = r.aiter_lines()
        async for line in lines:
            if events_wanted is not None and line.startswith("data: "):
                events_wanted -= 1
                if events_wanted == 0:
                    return "abandoned"  # leaving the block closes the connection mid-stream
        return str(r.status_code)


async def _run(url: str, model: str, total: int, concurrency: int, seed: int) -> Counter[str]:
    rng = random.Random(seed)
    kinds = [rng.choice(KINDS) for _ in range(total)]
    outcomes: Counter[str] = Counter()
    queue = iter(kinds)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def worker(wrng: random.Random):
            for kind in queue:
                outcomes[await _one(client, model, kind, wrng)] += 1
        await asyncio.gather(*(worker(random.Random(rng.random())) for _ in range(concurrency)))
    outcomes.update(f"kind:{k}" for k in kinds)
    return outcomes


def run(url: str, model: str, total: int, concurrency: int = 32, warmup: int = 200, seed: int = 0) -> dict:
    """Warm up, take the baseline, send ``total`` mixed requests, wait for the server to settle; the
    figures before and after, and the requests' outcomes."""
    asyncio.run(_run(url, model, warmup, concurrency, seed + 1))
    before = settled(url, snapshot(url), timeout_s=5.0)
    start = time.monotonic()
    outcomes = asyncio.run(_run(url, model, total, concurrency, seed))
    seconds = time.monotonic() - start
    after = settled(url, before)
    return {"requests": total, "warmup_requests": warmup, "concurrency": concurrency, "seconds": round(seconds, 1),
            "outcomes": dict(sorted(outcomes.items())), "before": before.as_dict(), "after": after.as_dict(),
            "rss_growth": after.rss_bytes / before.rss_bytes - 1}


def check(result: dict) -> None:
    """RSS grew under 10% after warm-up; descriptors, tasks, the engine's queues and KV cache are back."""
    before, after, outcomes = result["before"], result["after"], result["outcomes"]
    assert set(outcomes) <= {"200", "abandoned", *(f"kind:{k}" for k in KINDS)}, outcomes  # no error of any kind
    assert result["rss_growth"] < 0.10, result
    assert after["open_fds"] <= before["open_fds"], result
    assert after["asyncio_tasks"] <= before["asyncio_tasks"], result
    assert (after["running"], after["waiting"]) == (0, 0) and after["kv_usage"] <= before["kv_usage"], result
