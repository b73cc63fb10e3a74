"""The OpenAI-compatible adapter, against real servers on 127.0.0.1.

Upstreams: another burstgate (the native engine behind our own OpenAI routes: the reference for
the wire format, since it is driven by the official openai SDK in tests/gateway), the instant mock
server, and broken servers (500s, malformed SSE, stalls, refused connections, a stream cut mid-way).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from backends.base import (
    BackendTimeoutError,
    GenerationRequest,
    InvalidRequestError,
    OverloadedError,
    SamplingParams,
    UnavailableError,
    UpstreamError,
)
from backends.http import RemoteConfig
from backends.openai_http import OpenAIHTTPBackend
from loadtest.mock_server import create_mock_app
from tests.conftest import MODEL
from tests.servers import free_port, serve_app

_ids = itertools.count()


def _adapter(url: str, **kw) -> OpenAIHTTPBackend:
    return OpenAIHTTPBackend(MODEL, RemoteConfig(url=url, **kw))


def _req(prompt=None, messages=None, **params) -> GenerationRequest:
    return GenerationRequest(f"o{next(_ids)}", MODEL, SamplingParams(**params), prompt=prompt, messages=messages)


async def _collect(backend, request):
    return [c async for c in backend.stream(request)]


@pytest.fixture(scope="module")
def upstream_gateway(start_gateway):
    with start_gateway() as served:
        yield served


@pytest.fixture(scope="module")
def upstream(upstream_gateway):
    return upstream_gateway[0]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_relays_the_same_answer_as_the_engine_itself(upstream_gateway, kind, stream):
    upstream, gateway = upstream_gateway
    kw = dict(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    req = (_req(messages=[{"role": "user", "content": "Name three fruits."}], **kw) if kind == "chat"
           else _req(prompt="The three primary colours are", **kw))
    req.stream = stream

    async def main():
        adapter = _adapter(f"{upstream}/v1")
        try:
            remote = await _collect(adapter, req)
        finally:
            await adapter.close()
        engine_backend = gateway.groups[MODEL].deployments[0].backend  # the upstream's own engine, directly
        local = await _collect(engine_backend, GenerationRequest("direct", MODEL, req.params, prompt=req.prompt,
                                                                 messages=req.messages))
        return remote, local

    remote, local = asyncio.run(main())
    assert "".join(c.text for c in remote) == "".join(c.text for c in local)
    assert remote[-1].finish_reason == "length"
    ru, lu = remote[-1].usage, local[-1].usage
    assert (ru.prompt_tokens, ru.completion_tokens) == (lu.prompt_tokens, lu.completion_tokens)
    assert sum(len(c.logprobs or []) for c in remote) == 12
    assert all(len(lp.top) == 2 for c in remote for lp in (c.logprobs or []))


def test_upstream_client_errors_stay_client_errors(upstream):
    async def main():
        adapter = _adapter(f"{upstream}/v1")
        try:
            with pytest.raises(InvalidRequestError) as e:
                await _collect(adapter, _req(prompt="x", max_tokens=99999))
            return e.value
        finally:
            await adapter.close()

    err = asyncio.run(main())
    assert "maximum context length" in err.message and err.param == "input_tokens"


def test_closing_the_stream_aborts_upstream(upstream, native_engine):
    async def main():
        adapter = _adapter(f"{upstream}/v1")
        try:
            for i in range(6):
                async for chunk in adapter.stream(_req(prompt=f"Essay {i}:", max_tokens=300, ignore_eos=True)):
                    if chunk.text:
                        break
        finally:
            await adapter.close()

    generated = native_engine.generation_tokens_total
    asyncio.run(main())
    blocks = native_engine.blocks
    for _ in range(200):  # each abort reaches the engine at its next step
        if not native_engine.has_unfinished() and blocks.num_free_blocks == blocks.num_blocks:
            break
        time.sleep(0.05)
    assert not native_engine.has_unfinished() and blocks.num_free_blocks == blocks.num_blocks
    assert native_engine.generation_tokens_total - generated < 6 * 300 / 2  # stopped long before their 300 tokens


def test_health_info_and_tokenizer_routes(upstream, native_engine):
    async def main():
        adapter = _adapter(f"{upstream}/v1")
        try:
            return (await adapter.health(), await adapter.info(), await adapter.tokenize("Hello world"),
                    await adapter.detokenize(native_engine.tokenizer.encode("Hello world")))
        finally:
            await adapter.close()

    healthy, info, ids, text = asyncio.run(main())
    assert healthy and info.model_ids == [MODEL] and info.max_model_len == 1024
    assert ids == native_engine.tokenizer.encode("Hello world") and text == "Hello world"


def test_mock_server_stream_with_usage():
    with serve_app(create_mock_app(MODEL)) as url:
        async def main():
            adapter = _adapter(f"{url}/v1")
            try:
                return await _collect(adapter, _req(prompt="a b c", max_tokens=5))
            finally:
                await adapter.close()

        chunks = asyncio.run(main())
    assert "".join(c.text for c in chunks) == " tok" * 5
    assert chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.completion_tokens == 5


# ------------------------------------------------------------------------------- broken upstreams
def _broken_app(mode: str) -> Starlette:
    async def handler(request):
        if mode == "500":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if mode == "429":
            return JSONResponse({"error": {"message": "slow down"}}, status_code=429)
        if mode == "503":
            return Response("overloaded", status_code=503)

        async def body():
            if mode == "malformed":
                yield b"data: {not json\n\n"
            elif mode == "cut":
                yield b'data: {"choices":[{"index":0,"text":"partial","finish_reason":null}]}\n\n'
            elif mode == "error-event":
                yield b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
                yield b'data: {"error":{"message":"engine died"}}\n\n'
                yield b"data: [DONE]\n\n"
            elif mode == "stall":
                await asyncio.sleep(30)
                yield b"data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", handler, methods=["POST"])])


@pytest.mark.parametrize("mode, error, text", [
    ("500", UpstreamError, "boom"),
    ("429", OverloadedError, "slow down"),
    ("503", UnavailableError, "503"),
    ("malformed", UpstreamError, "malformed"),
    ("cut", UpstreamError, "without a finish reason"),
    ("error-event", UpstreamError, "engine died"),
    ("stall", BackendTimeoutError, "timed out"),
])
def test_broken_upstreams_map_to_typed_errors(mode, error, text):
    with serve_app(_broken_app(mode)) as url:
        async def main():
            adapter = _adapter(f"{url}/v1", read_timeout_s=1.0)
            try:
                with pytest.raises(error) as e:
                    await _collect(adapter, _req(prompt="x", max_tokens=3))
                return e.value
            finally:
                await adapter.close()

        assert text in asyncio.run(main()).message


def test_refused_connection_is_unavailable():
    async def main():
        adapter = _adapter(f"http://127.0.0.1:{free_port()}/v1")
        try:
            assert not await adapter.health()
            with pytest.raises(UnavailableError):
                await _collect(adapter, _req(prompt="x"))
        finally:
            await adapter.close()

    asyncio.run(main())


def test_sampling_fields_sent_only_when_set():
    from backends.openai_http import _sampling_fields

    plain = _sampling_fields(SamplingParams(max_tokens=5), chat=True)
    assert plain == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 5}
    extras = _sampling_fields(SamplingParams(max_tokens=5, top_k=3, ignore_eos=True, logprobs=2, stop=["x"]), chat=True)
    assert extras["top_k"] == 3 and extras["ignore_eos"] and extras["top_logprobs"] == 2 and extras["logprobs"] is True
    assert json.dumps(extras)
