"""The native engine's thread dies: nothing hangs, every caller hears 503, and the pod stops being ready."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.conftest import MODEL

LONG = {"model": MODEL, "prompt": "Write a very long story:", "max_tokens": 400, "ignore_eos": True}


class EngineThreadKilled(BaseException):
    """What kills a thread outright: not an ``Exception``, so no per-step handler catches it."""


async def _stream_after_first_token(client: httpx.AsyncClient, started: asyncio.Event) -> list[str]:
    events = []
    async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                started.set()
    return events


def test_engine_thread_death_fails_in_flight_requests_with_503_and_turns_ready_off(
        start_gateway, native_engine, monkeypatch, engine_idle):
    def crash():
        raise EngineThreadKilled("injected")

    async def main(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            started = asyncio.Event()
            streamed = asyncio.create_task(_stream_after_first_token(client, started))
            folded = asyncio.create_task(client.post("/v1/completions", json=LONG))
            await asyncio.wait_for(started.wait(), 30)
            while native_engine.stats().running < 2:  # both requests are in the engine
                await asyncio.sleep(0.01)
            monkeypatch.setattr(native_engine, "step", crash)
            events, reply = await asyncio.wait_for(asyncio.gather(streamed, folded), 30)  # nothing hangs
            after = await client.post("/v1/completions", json=LONG)
        return events, reply, after

    with start_gateway(router={"health_interval_s": 0.1, "retry_backoff_s": 0}) as (url, gateway):
        async_engine = gateway.groups[MODEL].deployments[0].backend._async
        events, reply, after = asyncio.run(main(url))

        assert isinstance(async_engine.dead, EngineThreadKilled) and not async_engine.alive
        # The stream had its 200: it ends with an in-band 503-class error, then [DONE].
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "service_unavailable"
        for r in (reply, after):  # before any byte was sent: a real 503
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/ready").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{url}/ready").json() == {"ready": False, "models": {MODEL: False}, "draining": False}
    # engine_idle: the dying thread aborted what the engine held, so no KV block is left behind.
