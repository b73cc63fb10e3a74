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

import json
import re
from collections.abc import Mapping
from typing import Any

from backends.base import (
    BackendInfo,
    FinishReason,
    GenerationChunk,
    InvalidRequestError,
    OverloadedError,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
    UnavailableError,
    UpstreamError,
    Usage,
)
from backends.http import json_body, raise_for_status
from backends.text_server import GenerateAPIBackend

FINISH_REASONS: dict[str, FinishReason] = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}
ERRORS = {422: InvalidRequestError, 400: InvalidRequestError, 413: InvalidRequestError, 424: UpstreamError,
          429: OverloadedError, 500: UpstreamError, 503: UnavailableError}


class TGIBackend(GenerateAPIBackend):
    kind = "tgi"
    openai_chat_path = "/v1"
    server_name = "text-generation-inference"
    # No TGI equivalent: TGI rejects what it cannot do rather than ignore it, and so do we. Structured outputs
    # it has: JSON schemas and regexes, as its ``grammar`` parameter (``grammar_parameter``).
    unsupported = ("min_p", "min_tokens", "ignore_eos", "stop_token_ids", "presence_penalty", "n", "logit_bias",
                   "prompt_logprobs", "tools", "echo")
    errors = ERRORS

    async def info(self) -> BackendInfo:
        r = await self._http.call("GET", "/info", timeout_s=5.0)
        _raise(r.status, r.content)
        info = json_body(r.content)
        return BackendInfo(model_ids=[info.get("model_id", self.upstream_model)],
                           max_model_len=info.get("max_total_tokens"), tokenizer=info.get("model_id"), extra=info)

    async def tokenize(self, text: str | None = None, messages: list[dict[str, Any]] | None = None,
                       add_special_tokens: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
        if text is None or tools:
            raise InvalidRequestError(f"{self.name} tokenizes text prompts only", param="messages")
        r = await self._http.call("POST", "/tokenize", json={"inputs": text})
        _raise(r.status, r.content)
        return [t["id"] for t in json_body(r.content)]

    def parameters(self, p: SamplingParams) -> dict[str, Any]:
        """Our sampling settings in TGI's terms; TGI wants temperature > 0 and top_p < 1, so they are sent
        only when they change something."""
        out: dict[str, Any] = {"details": True, "do_sample": not p.greedy, "stop": p.stop}
        if p.max_tokens is not None:
            out["max_new_tokens"] = p.max_tokens
        if not p.greedy:
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
        if p.structured is not None:
            out["grammar"] = grammar_parameter(p.structured)
        return out


    def reply_chunk(self, reply: Any, headers: Mapping[str, str], params: SamplingParams) -> GenerationChunk:
        details = reply.get("details") or {}
        tokens = details.get("tokens") or []
        tops = details.get("top_tokens") or [[]] * len(tokens)
        return GenerationChunk(
            text=reply.get("generated_text", ""), token_ids=[t["id"] for t in tokens],
            logprobs=[_logprob(t, top) for t, top in zip(tokens, tops)] if params.logprobs is not None else None,
            finish_reason=_finish(details),
            usage=Usage(int(headers.get("x-prompt-tokens", 0)), details.get("generated_tokens", len(tokens))))

    def event_chunk(self, event: Any, params: SamplingParams) -> GenerationChunk | None:
        if not isinstance(event, dict):
            return None
        if "error" in event:
            raise ERRORS.get(_status_of(event), UpstreamError)(f"upstream error mid-stream: {event['error']}")
        token, details = event["token"], event.get("details")
        return GenerationChunk(
            text="" if token.get("special") and params.skip_special_tokens else token["text"], token_ids=[token["id"]],
            logprobs=[_logprob(token, event.get("top_tokens") or [])] if params.logprobs is not None else None,
            finish_reason=_finish(details) if details else None,
            usage=Usage(details.get("input_length", 0), details["generated_tokens"]) if details else None)


def _finish(details: dict) -> FinishReason:
    return FINISH_REASONS.get(details.get("finish_reason") or "", "stop")


def _logprob(token: dict, top: list[dict]) -> TokenLogprob:
    return TokenLogprob(token["id"], token["text"], token.get("logprob") or 0.0,
                        [(t["id"], t["text"], t.get("logprob") or 0.0) for t in top])


_STATUS_OF_TYPE = {"validation": 422, "generation": 424, "overloaded": 429, "incomplete_generation": 500}


def _status_of(error: dict) -> int:
    return _STATUS_OF_TYPE.get(error.get("error_type", ""), 500)


def _raise(status: int, content: bytes) -> None:
    raise_for_status(status, content, ERRORS, "error")


def grammar_parameter(so: StructuredOutput) -> dict[str, Any]:
    """A constraint as TGI's ``grammar`` (router/src/lib.rs ``GrammarType``: ``{"type": "json", "value":
    <schema>}`` or ``{"type": "regex", "value": <pattern>}``); a choice is a regex of its escaped options.
    TGI has no EBNF grammars nor structural tags: those are refused naming the field."""
    if so.kind == "json":
        return {"type": "json", "value": json.loads(so.spec)}
    if so.kind == "json_object":
        return {"type": "json", "value": {"type": "object"}}
    if so.kind == "regex":
        return {"type": "regex", "value": so.spec}
    if so.kind == "choice":
        return {"type": "regex", "value": "|".join(re.escape(c) for c in json.loads(so.spec))}
    raise InvalidRequestError(f"{so.param}: {so.kind} constraints are not supported by text-generation-inference "
                              "(JSON schemas and regexes are)", param=so.param)
