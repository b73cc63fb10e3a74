"""vLLM's tokenizer routes, by the tokenizer of the model's backend: ``/tokenize``, ``/detokenize``, and the render
routes (``/v1/chat/completions/render``, ``/v1/completions/render``: a request as the engine gets it, for routers
that place requests by their token blocks). vLLM 0.32 serves the render routes only with ``--enable-scale-out``;
they generate nothing and tell no more than ``/tokenize`` does, so burstgate serves them always."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from backends.base import InvalidRequestError, random_id
from gateway.auth import authenticate
from gateway.routes import gateway_of
from gateway.routing import ModelGroup
from gateway.service import Caller, Gateway
from gateway.wire import schemas
from gateway.wire.render import rendered
from gateway.wire.requests import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

router = APIRouter(tags=["vllm"])


@router.post("/tokenize", responses=schemas.ok(schemas.TokenizeResponse, 404, 502, 503, 504))
async def tokenize(body: TokenizeRequest, request: Request, _: Caller = Depends(authenticate)):
    backend = model_group(gateway_of(request), body.model).choose().backend
    messages = [m.as_template_input() for m in body.messages] if body.messages is not None else None
    tools = [t.as_template_input() for t in body.tools] if body.tools else None
    ids = await backend.tokenize(body.prompt, messages, body.add_special_tokens, tools)
    info = await backend.info()
    out: dict[str, Any] = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [await backend.detokenize([i]) for i in ids]
    return out


@router.post("/detokenize", responses=schemas.ok(schemas.DetokenizeResponse, 404, 502, 503, 504))
async def detokenize(body: DetokenizeRequest, request: Request, _: Caller = Depends(authenticate)):
    backend = model_group(gateway_of(request), body.model).choose().backend
    return {"prompt": await backend.detokenize(body.tokens)}


@router.post("/v1/chat/completions/render", responses=schemas.ok(schemas.RenderedRequest, 404, 502, 503, 504))
async def render_chat(body: ChatCompletionRequest, request: Request, _: Caller = Depends(authenticate)):
    """The chat through the model's chat template (tools included), as token ids, with its sampling parameters."""
    generation = body.generation_request(f"chatcmpl-{random_id()}")  # the chat route's checks
    backend = gateway_of(request).group(body.model).choose().backend
    ids = await backend.tokenize(None, generation.messages, generation.add_special_tokens, generation.tools)
    return rendered(generation.request_id, ids, generation, (await backend.info()).max_model_len)


@router.post("/v1/completions/render", responses={
    **schemas.ok(schemas.RenderedRequest, 404, 502, 503, 504), 200: {"model": list[schemas.RenderedRequest]}})
async def render_completion(body: CompletionRequest, request: Request, _: Caller = Depends(authenticate)):
    """Each prompt as token ids with its sampling parameters (one answer per prompt, in order)."""
    request_id = f"cmpl-{random_id()}"
    generations = body.generation_requests(request_id)
    backend = gateway_of(request).group(body.model).choose().backend
    max_model_len = (await backend.info()).max_model_len
    answers = []
    for i, generation in enumerate(generations):
        prompt = generation.prompt
        ids = prompt if isinstance(prompt, list) else await backend.tokenize(prompt, None,
                                                                             generation.add_special_tokens)
        answers.append(rendered(f"{request_id}-{i}", ids, generation, max_model_len))
    return answers


def model_group(gateway: Gateway, model: str | None) -> ModelGroup:
    """The named model's group; without a name, the one model served (vLLM's routes serve one model)."""
    if model is None:
        if len(gateway.groups) != 1:
            raise InvalidRequestError("model is required when several models are served", param="model")
        return next(iter(gateway.groups.values()))
    return gateway.group(model)
