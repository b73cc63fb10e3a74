"""vLLM's tokenizer routes: ``/tokenize`` and ``/detokenize``, by the tokenizer of the model's backend."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from backends.base import InvalidRequestError
from gateway.auth import authenticate
from gateway.routes import gateway_of
from gateway.routing import ModelGroup
from gateway.service import Caller, Gateway
from gateway.wire import schemas
from gateway.wire.requests import DetokenizeRequest, TokenizeRequest

router = APIRouter(tags=["vllm"])


@router.post("/tokenize", responses=schemas.ok(schemas.TokenizeResponse, 404, 502, 503, 504))
async def tokenize(body: TokenizeRequest, request: Request, _: Caller = Depends(authenticate)):
    backend = model_group(gateway_of(request), body.model).choose().backend
    messages = [m.as_template_input() for m in body.messages] if body.messages is not None else None
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    ids = await backend.tokenize(body.prompt, messages, body.add_special_tokens, tools)
    info = await backend.info()
    out = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [await backend.detokenize([i]) for i in ids]
    return out


@router.post("/detokenize", responses=schemas.ok(schemas.DetokenizeResponse, 404, 502, 503, 504))
async def detokenize(body: DetokenizeRequest, request: Request, _: Caller = Depends(authenticate)):
    backend = model_group(gateway_of(request), body.model).choose().backend
    return {"prompt": await backend.detokenize(body.tokens)}


def model_group(gateway: Gateway, model: str | None) -> ModelGroup:
    """The named model's group; without a name, the one model served (vLLM's routes serve one model)."""
    if model is None:
        if len(gateway.groups) != 1:
            raise InvalidRequestError("model is required when several models are served", param="model")
        return next(iter(gateway.groups.values()))
    return gateway.group(model)
