"""Clients that vanish en masse: half hang up before their first token, half after it. The engine goes
idle, its KV cache returns to where it was, and it generates nothing for anybody who left."""

from __future__ import annotations

import asyncio
import collections
import json
import time

import httpx

from tests.conftest import MODEL

N = 8  # streams in each half
BODY = {"model": MODEL, "prompt": "Write a very long essay:", "max_tokens": 400, "ignore_eos": True, "stream": True}


async def _until(condition, timeout: float = 10.0) -> bool:
    for _ in range(int(timeout / 0.01)):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


def test_streams_hanging_up_before_and_after_their_first_token_leave_the_engine_idle(
        start_gateway, native_engine, monkeypatch, engine_idle):
    produced: collections.Counter[str] = collections.Counter()  # tokens the engine made, per request id
    real_step = native_engine.step

    def counting_step():
        outputs = real_step()
        produced.update(request_id for request_id, _ in outputs)
        return outputs

    monkeypatch.setattr(native_engine, "step", counting_step)
    kv_before = native_engine.blocks.usage

    async def burst(url: str, limiter) -> tuple[list[str], bool]:
        after_ids: list[str] = []
        release = asyncio.Event()
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def hang_up_after_first_token():
                async with client.stream("POST", "/v1/completions", json=BODY) as r:
                    lines = r.aiter_lines()  # held: a dropped line iterator would close the response now
                    while not (line := await anext(lines)).startswith("data: "):
                        pass
                    after_ids.append(json.loads(line[len("data: "):])["id"])
                    await release.wait()  # keep the deployment's slots until the other half has left

            async def hang_up_before_first_token():
                await client.send(client.build_request("POST", "/v1/completions", json=BODY), stream=True)

            after = [asyncio.create_task(hang_up_after_first_token()) for _ in range(N)]
            assert await _until(lambda: len(after_ids) == N, 60)
            before = [asyncio.create_task(hang_up_before_first_token()) for _ in range(N)]
            assert await _until(lambda: limiter.waiting == N)  # queued behind the first half, no token yet
            for task in before:
                task.cancel()  # drops each connection
            await asyncio.gather(*before, return_exceptions=True)
            abandoned = await _until(lambda: limiter.waiting == 0)  # noticed while waiting for a first token
            release.set()
            await asyncio.gather(*after)
        return after_ids, abandoned

    def idle() -> bool:
        stats = native_engine.stats()
        return stats.running == stats.waiting == 0 and stats.kv_usage == kv_before

    with start_gateway(max_concurrency=N) as (url, gateway):
        after_ids, abandoned = asyncio.run(burst(url, gateway.groups[MODEL].deployments[0].limiter))
        assert abandoned, "requests whose clients left before their first token were still queued"
        assert asyncio.run(_until(idle)), f"the engine is not idle: {native_engine.stats()}"
        generated = native_engine.generation_tokens_total
        time.sleep(0.3)
        assert native_engine.generation_tokens_total == generated, "the engine still generates for clients who left"
    # Only the half that saw a token ever got one; each was cut short of its 400.
    assert set(produced) == set(after_ids)
    assert all(produced[rid] < BODY["max_tokens"] for rid in after_ids)
