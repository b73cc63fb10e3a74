"""LightLLM, through its native API (the engine named in the reference study, arXiv 2311.03687).

Wire format (ModelTC/lightllm, lightllm/server/api_lightllm.py and api_http.py): ``POST /generate``
and ``/generate_stream`` take ``{"inputs", "parameters"}`` (TGI-like names plus ``ignore_eos``,
``min_new_tokens``, ``stop_sequences``, ``presence_penalty``); ``/generate`` answers
``{generated_text: [text], count_output_tokens, finish_reason, prompt_tokens}``; each stream event is
``data:{"token": {id, text, logprob, special, count_output_tokens, prompt_tokens}, "generated_text":
null, "finished", "finish_reason", "details": null}``. Errors are ``{"message"}`` with 503 when the
server is busy and 417 for everything else (invalid parameters included). Chat goes to its
``/v1/chat/completions`` or through a local chat template.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends.base import (
    FinishReason,
    GenerationChunk,
    InvalidRequestError,
    OverloadedError,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from backends.text_server import GenerateAPIBackend

# 417 is LightLLM's answer to any exception while validating or generating; its messages are the
# ValueErrors of SamplingParams.verify(), so they are the client's to read.
ERRORS = {417: InvalidRequestError, 503: OverloadedError}


class LightLLMBackend(GenerateAPIBackend):
    kind = "lightllm"
    openai_chat_path = "/v1"
    server_name = "LightLLM"
    unsupported = ("min_p", "stop_token_ids", "seed", *GenerateAPIBackend.unsupported)
    errors = ERRORS
    error_field = "message"

    def parameters(self, p: SamplingParams) -> dict[str, Any]:
        """Our sampling settings in LightLLM's terms (it wants temperature > 0, so greedy is do_sample false)."""
        if p.logprobs:  # it streams the chosen token's logprob, never alternatives
            raise InvalidRequestError("logprobs alternatives are not supported by LightLLM backends", param="logprobs")
        out: dict[str, Any] = {"do_sample": not p.greedy, "ignore_eos": p.ignore_eos,
                               "skip_special_tokens": p.skip_special_tokens}
        if p.max_tokens is not None:
            out["max_new_tokens"] = p.max_tokens
        if p.min_tokens:
            out["min_new_tokens"] = p.min_tokens
        if p.stop:
            out["stop_sequences"] = p.stop
        if not p.greedy:
            out.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else -1)
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            value, default = getattr(p, name), 1.0 if name == "repetition_penalty" else 0.0
            if value != default:
                out[name] = value
        return out

    def reply_chunk(self, reply: Any, headers: Mapping[str, str], params: SamplingParams) -> GenerationChunk:
        texts = reply.get("generated_text") or [""]
        return GenerationChunk(text=texts[0], finish_reason=_finish(reply.get("finish_reason")),
                               usage=Usage(reply.get("prompt_tokens", 0), reply.get("count_output_tokens", 0)))

    def event_chunk(self, event: Any, params: SamplingParams) -> GenerationChunk | None:
        token, finished = event["token"], event.get("finished")
        return GenerationChunk(
            text=token.get("text") or "", token_ids=[token["id"]] if token.get("id") is not None else [],
            logprobs=[TokenLogprob(token.get("id") or -1, token.get("text") or "", token.get("logprob") or 0.0)]
            if params.logprobs is not None else None,
            finish_reason=_finish(event.get("finish_reason")) if finished else None,
            usage=Usage(token.get("prompt_tokens", 0), token.get("count_output_tokens", 0)) if finished else None)


def _finish(reason: str | None) -> FinishReason:
    return "length" if reason == "length" else "stop"
