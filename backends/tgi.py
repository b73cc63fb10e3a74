"""Hugging Face text-generation-inference, through its native API.

Wire format (huggingface/text-generation-inference, router/src/server.rs and lib.rs):
``POST /generate`` and ``/generate_stream`` take ``{"inputs", "parameters"}``; the stream is SSE
``data:{"index", "token": {id, text, logprob, special}, "top_tokens", "generated_text", "details"}``,
the last event carrying ``generated_text`` and ``details {finish_reason, generated_tokens, seed,
input_length}``, and no ``[DONE]``. ``/generate`` answers ``{generated_text, details}`` with the
prompt length in the ``x-prompt-tokens`` header. Errors are ``{"error", "error_type"}`` with 422
(validation), 424 (generation), 429 (overloaded), 500 (incomplete generation). Chat goes to TGI's
OpenAI route ``/v1/chat/completions`` or through a local chat template (``chat:`` in the config).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from backends.base import (
    BackendInfo,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    OverloadedError,
    SamplingParams,
    TokenLogprob,
    UnavailableError,
    UpstreamError,
    Usage,
)
from backends.http import json_body, raise_for_status, sse_events
from backends.text_server import TextServerBackend

FINISH_REASONS = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}
ERRORS = {422: InvalidRequestError, 400: InvalidRequestError, 413: InvalidRequestError, 424: UpstreamError,
          429: OverloadedError, 500: UpstreamError, 503: UnavailableError}


class TGIBackend(TextServerBackend):
    kind = "tgi"

    openai_chat_path = "/v1"

    async def info(self) -> BackendInfo:
        r = await self._http.call("GET", "/info", timeout_s=5.0)
        _raise(r.status, r.content)
        info = json_body(r.content)
        return BackendInfo(model_ids=[info.get("model_id", self.upstream_model)],
                           max_model_len=info.get("max_total_tokens"), tokenizer=info.get("model_id"), extra=info)

    async def tokenize(self, text: str | None = None, messages: list[dict[str, Any]] | None = None,
                       add_special_tokens: bool = True) -> list[int]:
        if text is None:
            raise InvalidRequestError(f"{self.name} tokenizes text prompts only", param="messages")
        r = await self._http.call("POST", "/tokenize", json={"inputs": text})
        _raise(r.status, r.content)
        return [t["id"] for t in json_body(r.content)]

    async def _generate(self, prompt: str, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        body = {"inputs": prompt, "parameters": parameters(request.params)}
        want_logprobs = request.params.logprobs is not None
        if not request.stream:
            r = await self._http.call("POST", "/generate", json=body)
            _raise(r.status, r.content)
            reply = json_body(r.content)
            details = reply.get("details") or {}
            tokens = details.get("tokens") or []
            yield GenerationChunk(
                text=reply.get("generated_text", ""), token_ids=[t["id"] for t in tokens],
                logprobs=[_logprob(t, top) for t, top in zip(tokens, details.get("top_tokens") or [[]] * len(tokens))]
                if want_logprobs else None,
                finish_reason=_finish(details),
                usage=Usage(int(r.headers.get("x-prompt-tokens", 0)), details.get("generated_tokens", len(tokens))))
            return
        async with self._http.stream("POST", "/generate_stream", json=body) as r:
            if r.status != 200:
                _raise(r.status, await r.read())
            async for event in sse_events(r):
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    raise ERRORS.get(_status_of(event), UpstreamError)(f"upstream error mid-stream: {event['error']}")
                token = event["token"]
                text = "" if token.get("special") and request.params.skip_special_tokens else token["text"]
                details = event.get("details")
                yield GenerationChunk(
                    text=text, token_ids=[token["id"]],
                    logprobs=[_logprob(token, event.get("top_tokens") or [])] if want_logprobs else None,
                    finish_reason=_finish(details) if details else None,
                    usage=Usage(details.get("input_length", 0), details["generated_tokens"]) if details else None)
                if details:
                    return


def parameters(p: SamplingParams) -> dict[str, Any]:
    """Our sampling settings in TGI's terms. TGI rejects what it cannot do rather than ignore it, and
    so do we: min_p, min_tokens, ignore_eos, stop_token_ids and presence_penalty have no TGI equivalent."""
    unsupported = {"min_p": p.min_p != 0.0, "min_tokens": p.min_tokens != 0, "ignore_eos": p.ignore_eos,
                   "stop_token_ids": bool(p.stop_token_ids), "presence_penalty": p.presence_penalty != 0.0}
    for name, used in unsupported.items():
        if used:
            raise InvalidRequestError(f"{name} is not supported by text-generation-inference backends", param=name)
    out: dict[str, Any] = {"details": True, "do_sample": not p.greedy, "stop": p.stop}
    if p.max_tokens is not None:
        out["max_new_tokens"] = p.max_tokens
    if not p.greedy:  # TGI wants temperature > 0 and top_p < 1: send them only when they change something
        if p.temperature != 1.0:
            out["temperature"] = p.temperature
        if p.top_p < 1.0:
            out["top_p"] = p.top_p
        if p.top_k > 0:
            out["top_k"] = p.top_k
    if p.seed is not None:
        out["seed"] = p.seed
    if p.repetition_penalty != 1.0:
        out["repetition_penalty"] = p.repetition_penalty
    if p.frequency_penalty != 0.0:
        out["frequency_penalty"] = p.frequency_penalty
    if p.logprobs:
        out["top_n_tokens"] = p.logprobs
    return out


def _finish(details: dict) -> str:
    return FINISH_REASONS.get(details.get("finish_reason"), "stop")


def _logprob(token: dict, top: list[dict]) -> TokenLogprob:
    return TokenLogprob(token["id"], token["text"], token.get("logprob") or 0.0,
                        [(t["id"], t["text"], t.get("logprob") or 0.0) for t in top])


_STATUS_OF_TYPE = {"validation": 422, "generation": 424, "overloaded": 429, "incomplete_generation": 500}


def _status_of(error: dict) -> int:
    return _STATUS_OF_TYPE.get(error.get("error_type", ""), 500)


def _raise(status: int, content: bytes) -> None:
    raise_for_status(status, content, ERRORS, "error")
