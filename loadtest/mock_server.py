"""An OpenAI-compatible server that answers instantly (or with set delays), for measuring the tools.

It lets a tester find the load tester's own capacity and a gateway's own overhead with no model in the
way. Output is ``max_tokens`` copies of one token. Prompts are counted with a real tokenizer (the
embedded SmolLM2's by default), for usage and vLLM's ``/tokenize`` and ``/detokenize`` routes: chat
prompts through its chat template, completion prompts with its special tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

TOKEN = " tok"


def create_mock_app(model: str = "mock", ttft_s: float = 0.0, itl_s: float = 0.0, tokenizer=None,
                    max_concurrency: int | None = None) -> Starlette:
    """``ttft_s`` delays the first token and ``itl_s`` every later one (both 0: instant); ``tokenizer``
    (default: the embedded SmolLM2's) counts prompts. ``max_concurrency`` serves that many requests at once
    and queues the rest, so the server has a known capacity: ``max_concurrency / (ttft_s + (n - 1) * itl_s)``
    requests/s for outputs of n tokens."""
    from loadtest.workload import load_tokenizer

    tokenizer = tokenizer or load_tokenizer(None)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    def count(body: dict, chat: bool) -> int:
        if chat:
            return len(tokenizer.apply_chat_template(body["messages"]))
        prompt = body["prompt"]
        if isinstance(prompt, list):  # token ids
            return len(prompt)
        return len(tokenizer.encode(str(prompt), add_special_tokens=body.get("add_special_tokens", True)))

    async def completions(request: Request) -> Response:
        return await _generate(request, chat=False)

    async def chat(request: Request) -> Response:
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool) -> Response:
        try:
            body = json.loads(await request.body())
            n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            prompt_tokens = count(body, chat)
        except Exception:  # unparseable JSON, missing fields, a chat template refusing the messages
            return _bad_request()
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        rid, created = f"mock-{uuid.uuid4().hex[:12]}", int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            async with slots:
                if ttft_s or itl_s:
                    await asyncio.sleep(ttft_s + itl_s * max(n - 1, 0))
            choice = ({"index": 0, "message": {"role": "assistant", "content": TOKEN * n}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": TOKEN * n, "finish_reason": "length"})
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model,
                                 "choices": [choice], "usage": usage})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices, with_usage=False) -> bytes:
            data = {"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": choices}
            if with_usage:
                data["usage"] = usage
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        async def stream():
            async with slots:
                for i in range(n):
                    delay = ttft_s if i == 0 else itl_s
                    if delay:
                        await asyncio.sleep(delay)
                    reason = "length" if i == n - 1 else None
                    yield event([{"index": 0, "delta": {"content": TOKEN}, "finish_reason": reason} if chat
                                 else {"index": 0, "text": TOKEN, "finish_reason": reason}])
            if include_usage:
                yield event([], with_usage=True)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                                          "owned_by": "mock", "max_model_len": 1 << 20}]})

    async def tokenize(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            if "messages" in body:
                tokens = tokenizer.apply_chat_template(body["messages"])
            else:
                tokens = tokenizer.encode(str(body["prompt"]), add_special_tokens=body.get("add_special_tokens", True))
        except Exception:
            return _bad_request()
        return JSONResponse({"count": len(tokens), "max_model_len": 1 << 20, "tokens": tokens})

    async def detokenize(request: Request) -> Response:
        try:
            text = tokenizer.decode(json.loads(await request.body())["tokens"], skip_special_tokens=False)
        except Exception:
            return _bad_request()
        return JSONResponse({"prompt": text})

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health),
    ])


def _bad_request() -> JSONResponse:
    return JSONResponse({"error": {"message": "bad request", "type": "invalid_request_error", "param": None,
                                   "code": None}}, status_code=400)
