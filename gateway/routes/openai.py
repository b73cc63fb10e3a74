"""OpenAI's generation routes: chat completions, completions, and the model list."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from backends.base import GenerationRequest, random_id
from gateway import streaming
from gateway.auth import authenticate
from gateway.routes import gateway_of
from gateway.service import Caller
from gateway.wire import schemas
from gateway.wire.encoding import ResponseWriter
from gateway.wire.requests import ChatCompletionRequest, CompletionRequest

router = APIRouter(tags=["openai"])


@router.post("/v1/chat/completions", responses=schemas.generation(schemas.ChatCompletion))
async def chat_completions(body: ChatCompletionRequest, request: Request, caller: Caller = Depends(authenticate)):
    gen = body.generation_request(f"chatcmpl-{random_id()}")
    writer = ResponseWriter(gen.request_id, body.model, True, gen.params.n, body.top_logprobs or 0,
                            body.include_usage, body.continuous_usage)
    return await serve(request, body, [gen], caller, writer)


@router.post("/v1/completions", responses=schemas.generation(schemas.Completion))
async def completions(body: CompletionRequest, request: Request, caller: Caller = Depends(authenticate)):
    request_id = f"cmpl-{random_id()}"
    gens = body.generation_requests(request_id)
    writer = ResponseWriter(request_id, body.model, False, len(gens) * gens[0].params.n, 0,
                            body.include_usage, body.continuous_usage)
    return await serve(request, body, gens, caller, writer)


async def serve(request: Request, body: ChatCompletionRequest | CompletionRequest, gens: list[GenerationRequest],
                caller: Caller, writer: ResponseWriter):
    """Admit the caller, route every generation request and answer: folded, or as a stream of events."""
    gateway = gateway_of(request)
    group = gateway.group(body.model)
    caller = await gateway.admit(caller, gens)
    streams = [gateway.generate(group, gen, caller) for gen in gens]
    stream = streams[0] if len(streams) == 1 else streaming.merge(streams, gens[0].params.n)
    if not body.stream:
        return await streaming.until_disconnect(request, streaming.fold(stream, writer))
    try:  # errors before the first token keep their HTTP status; a client gone by then aborts the work
        head = await streaming.until_disconnect(request, streaming.first(stream))
    except BaseException:
        await stream.aclose()
        raise
    return StreamingResponse(streaming.sse(head, stream, writer), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@router.get("/v1/models", responses=schemas.ok(schemas.ModelList))
async def list_models(request: Request, _: Caller = Depends(authenticate)):
    data = []
    for name, group in gateway_of(request).groups.items():
        info = await _first_info(group)
        data.append({"id": name, "object": "model", "created": 0, "owned_by": "burstgate",
                     "max_model_len": info.max_model_len if info else None})
    return {"object": "list", "data": data}


async def _first_info(group):
    for d in group.deployments:
        with contextlib.suppress(Exception):
            return await d.backend.info()
    return None
