"""vLLM's render answer (``/v1/chat/completions/render``, ``/v1/completions/render``): a request as the engine would
get it, generating nothing: the prompt's token ids (through the chat template for chats) and the sampling
parameters under ``vllm.SamplingParams``' names, in vLLM 0.32's ``GenerateRequest`` shape. Routers that place
requests by token blocks (``vllm-router``) ask for it before they route."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from backends.base import GenerationRequest, InvalidRequestError, SamplingParams, StructuredOutput, refuse_extra_fields

# vLLM's RequestOutputKind: a streamed request's outputs come as deltas, a whole one's once at the end
OUTPUT_DELTA, OUTPUT_FINAL_ONLY = 1, 2


def rendered(request_id: str, token_ids: list[int], request: GenerationRequest, max_model_len: int | None
             ) -> dict[str, Any]:
    """The render answer for ``request`` whose prompt is ``token_ids``; a prompt the generation would refuse for its
    length is refused (vLLM's words), and so is a field that would be forwarded to a server: nothing generates here
    to honour it."""
    refuse_extra_fields(request, "the render routes")
    if not token_ids:
        raise InvalidRequestError("The prompt is empty: nothing to render.", param="prompt")
    p = request.params
    max_tokens: int | None = p.max_tokens
    if request.calls_tools:
        p = dataclasses.replace(p, skip_special_tokens=False)
    if max_model_len is not None:
        max_tokens = p.max_tokens if p.max_tokens is not None else max(max_model_len - len(token_ids), 1)
        if len(token_ids) + max_tokens > max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{max_tokens} output tokens and your prompt contains {len(token_ids)} input tokens, for a total of "
                f"{len(token_ids) + max_tokens} tokens. Please reduce the length of the input prompt or the number "
                "of requested output tokens.", param="input_tokens", code="context_length_exceeded")
    return {"request_id": request_id, "token_ids": token_ids, "token_offsets": None, "features": None,
            "content_parts": None, "sampling_params": sampling_params(p, max_tokens, request.stream),
            "model": request.model, "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
            "output_mode": "tokens", "stream": request.stream, "stream_options": None, "cache_salt": None,
            "priority": 0, "kv_transfer_params": None, "ec_transfer_params": None}


def sampling_params(p: SamplingParams, max_tokens: int | None, stream: bool) -> dict[str, Any]:
    """``p`` as vLLM writes its ``SamplingParams``: the fields it always writes, then those set away from their
    defaults; greedy requests without top-p and min-p (vLLM resets them); ``max_tokens`` as it will be generated
    (the context's end where the request set none)."""
    out: dict[str, Any] = {"n": p.n} if p.n != 1 else {}
    out |= {"presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty, "temperature": p.temperature}
    if not p.greedy:
        out |= {"top_p": p.top_p, "min_p": p.min_p} | ({"top_k": p.top_k} if p.top_k > 0 else {})
    optional = {"seed": p.seed, "logprobs": p.logprobs, "prompt_logprobs": p.prompt_logprobs}
    out |= {name: value for name, value in optional.items() if value is not None}
    out |= {"stop": list(p.stop), "stop_token_ids": list(p.stop_token_ids), "max_tokens": max_tokens}
    flags = {"ignore_eos": p.ignore_eos, "min_tokens": p.min_tokens, "skip_special_tokens": p.skip_special_tokens}
    out |= {name: value for name, value in flags.items() if value != SamplingParams.__dataclass_fields__[name].default}
    if p.logit_bias:
        out["logit_bias"] = {str(token): bias for token, bias in p.logit_bias.items()}
    if p.structured is not None:
        out["structured_outputs"] = _structured(p.structured)
    return out | {"output_kind": OUTPUT_DELTA if stream else OUTPUT_FINAL_ONLY, "skip_clone": True, "bad_words": [],
                  "skip_reading_prefix_cache": False}


def _structured(so: StructuredOutput) -> dict[str, Any]:
    """A constraint as vLLM's ``StructuredOutputsParams``."""
    if so.kind in ("json", "choice"):
        value: Any = json.loads(so.spec)
    else:
        value = True if so.kind == "json_object" else so.spec  # regex, grammar, structural tag: the text itself
    return {so.kind: value} | ({} if so.any_whitespace else {"disable_any_whitespace": True})
