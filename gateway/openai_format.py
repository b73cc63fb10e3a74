"""GenerationChunks → OpenAI response objects (chat and text completions, streamed and folded)."""

from __future__ import annotations

import json
import time

from backends.base import GenerationChunk, TokenLogprob, Usage


def usage_dict(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    out = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
           "total_tokens": usage.total_tokens}
    if usage.cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return out


def _finish(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


def _token_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": max(logprob, -9999.0), "bytes": list(token.encode("utf-8", "replace"))}


def chat_logprobs(lps: list[TokenLogprob] | None) -> dict | None:
    if lps is None:
        return None
    return {"content": [{**_token_entry(lp.token, lp.logprob),
                         "top_logprobs": [_token_entry(t, l) for _, t, l in lp.top]} for lp in lps]}


def completion_logprobs(lps: list[TokenLogprob] | None, text_offset: int = 0) -> dict | None:
    if lps is None:
        return None
    offsets, pos = [], text_offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t: l for _, t, l in lp.top} for lp in lps], "text_offset": offsets}


class ResponseWriter:
    """Builds the response objects of one request, chat or text-completion flavoured."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._text_offset = 0

    def full(self, f: GenerationChunk) -> dict:
        """The whole answer from a stream folded into one chunk (``GenerationChunk.extend``)."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": f.text},
                      "logprobs": chat_logprobs(f.logprobs), "finish_reason": _finish(f.finish_reason)}
        else:
            choice = {"index": 0, "text": f.text, "logprobs": completion_logprobs(f.logprobs),
                      "finish_reason": _finish(f.finish_reason)}
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage_dict(f.usage)}

    # ------------------------------------------------------------------------------------ stream
    def _event(self, choices: list[dict], usage: dict | None = None, with_usage_key: bool = False) -> bytes:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or with_usage_key:
            body["usage"] = usage
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def role_event(self) -> bytes | None:
        """Chat streams open with the assistant role, as OpenAI's do."""
        if not self.chat:
            return None
        return self._event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def chunk_event(self, chunk: GenerationChunk, usage: Usage | None = None) -> bytes | None:
        if not chunk.text and chunk.finish_reason is None and usage is None:
            return None  # e.g. a token held back while it may begin a stop string
        if self.chat:
            delta = {"content": chunk.text} if chunk.text else {}
            choice = {"index": 0, "delta": delta, "logprobs": chat_logprobs(chunk.logprobs),
                      "finish_reason": _finish(chunk.finish_reason)}
        else:
            choice = {"index": 0, "text": chunk.text, "logprobs": completion_logprobs(chunk.logprobs, self._text_offset),
                      "finish_reason": _finish(chunk.finish_reason)}
            self._text_offset += len(chunk.text)
        return self._event([choice], usage_dict(usage), with_usage_key=usage is not None)

    def usage_event(self, usage: Usage | None) -> bytes:
        """The extra last chunk of ``stream_options.include_usage``: no choices, just usage."""
        return self._event([], usage_dict(usage), with_usage_key=True)


DONE = b"data: [DONE]\n\n"
