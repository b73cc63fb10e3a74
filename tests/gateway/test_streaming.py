"""Raw SSE framing, and client disconnects (streamed or not) aborting the engine's work."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.conftest import MODEL


def _events(raw: str) -> list[str]:
    assert raw.endswith("\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] for e in events]


def test_sse_framing_and_done(gateway_url):
    with httpx.stream("POST", f"{gateway_url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.read().decode())
    assert events[-1] == "[DONE]"
    bodies = [json.loads(e) for e in events[:-1]]
    assert all(b["object"] == "chat.completion.chunk" for b in bodies)
    assert len({b["id"] for b in bodies}) == 1
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] > 0


def _stream(url: str, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/{route}", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        events = _events(r.read().decode())
    return [json.loads(e) for e in events[:-1]]


def test_continuous_usage_is_on_every_chunk_and_counts_up(gateway_url):
    """vLLM's continuous_usage_stats (checked against vLLM in tests/peers: stream_continuous_usage)."""
    bodies = _stream(gateway_url, "completions", {"prompt": "Count:", "max_tokens": 6, "ignore_eos": True,
                                                  "stream_options": {"include_usage": True,
                                                                     "continuous_usage_stats": True}})
    assert all(b.get("usage") for b in bodies)
    counts = [b["usage"]["completion_tokens"] for b in bodies]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] <= 1


def test_streamed_logprobs_cover_every_token_even_those_without_text(gateway_url):
    """A stream has one logprob entry per generated token, also for a chunk whose token shows no text
    (vLLM's; tests/peers: stream_logprobs, chat_stream_logprobs)."""
    for route, body, entries in [
            ("completions", {"prompt": "Say <|im_end|> then", "logprobs": 1}, lambda c: c["logprobs"]["tokens"]),
            ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True},
             lambda c: c["logprobs"]["content"])]:
        bodies = _stream(gateway_url, route, {**body, "max_tokens": 12, "ignore_eos": True, "temperature": 0,
                                              "skip_special_tokens": True, "logit_bias": {"2": 30},
                                              "stream_options": {"include_usage": True}})
        choices = [c for b in bodies for c in b["choices"]]
        assert sum(len(entries(c) or []) for c in choices if c.get("logprobs")) == 12 == bodies[-1]["usage"][
            "completion_tokens"]


def test_error_before_first_token_keeps_http_status(gateway_url):
    r = httpx.post(f"{gateway_url}/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True,
                                                          "max_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_tokens"


async def _disconnect_midstream(url: str, i: int) -> int:
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", f"{url}/v1/completions", json={
                "model": MODEL, "prompt": f"Write a very long essay number {i}:", "max_tokens": 400,
                "ignore_eos": True, "stream": True}) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 2 + i % 5:
                    break  # leaving the block closes the connection mid-stream
    return seen


def test_disconnecting_mid_stream_many_times_frees_every_block(gateway_url, engine_idle):
    async def main():
        return await asyncio.gather(*(_disconnect_midstream(gateway_url, i) for i in range(24)))

    assert all(n >= 2 for n in asyncio.run(main()))
    # engine_idle asserts no sequence and no KV block is left once the aborts land.


def test_non_streaming_disconnect_aborts_the_request(gateway_url, engine_idle, native_engine):
    async def main():
        async with httpx.AsyncClient() as client:
            task = asyncio.create_task(client.post(f"{gateway_url}/v1/completions", json={
                "model": MODEL, "prompt": "A long story:", "max_tokens": 900, "ignore_eos": True}, timeout=120))
            for _ in range(200):  # wait until the engine is working on it
                await asyncio.sleep(0.02)
                if native_engine.has_unfinished():
                    break
            assert native_engine.has_unfinished()
            task.cancel()  # drops the connection
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_backend_failure_mid_stream_is_an_sse_error_then_done(start_gateway):
    """A backend that dies after the first token: the client gets an SSE error event and [DONE]."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from backends.http import RemoteConfig
    from backends.openai_http import OpenAIHTTPBackend
    from gateway.app import create_app
    from gateway.config import Settings
    from gateway.deployments import Deployment
    from gateway.limits import ConcurrencyLimiter
    from gateway.routing import ModelGroup
    from gateway.service import Gateway
    from tests.servers import serve_app

    async def dying(request):
        async def body():
            yield b'data: {"choices":[{"index":0,"text":"partial","finish_reason":null}]}\n\n'
            yield b'data: {"error":{"message":"engine crashed"}}\n\n'
        return StreamingResponse(body(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "m"}]})

    upstream = Starlette(routes=[Route("/v1/completions", dying, methods=["POST"]), Route("/v1/models", models)])
    with serve_app(upstream) as up:
        backend = OpenAIHTTPBackend("m", RemoteConfig(url=f"{up}/v1"))
        deployment = Deployment(name="dying", backend=backend, limiter=ConcurrencyLimiter(8, 8))
        gateway = Gateway(Settings(), [ModelGroup("m", [deployment])])
        with serve_app(create_app(gateway)) as url:
            with httpx.stream("POST", f"{url}/v1/completions", json={"model": "m", "prompt": "x", "stream": True}) as r:
                assert r.status_code == 200
                events = _events(r.read().decode())
    assert json.loads(events[0])["choices"][0]["text"] == "partial"
    error = json.loads(events[1])["error"]
    assert "engine crashed" in error["message"] and error["type"] == "upstream_error"
    assert events[2:] == ["[DONE]"]
