"""GenerationChunks → OpenAI response objects (chat and text completions, streamed and folded).

The objects have the keys vLLM 0.32's OpenAI server writes, in its order (vllm/entrypoints/openai/
chat_completion/protocol.py and completion/protocol.py), so a client written against vLLM finds every
field it reads: OpenAI's own (``refusal``, ``annotations``, ``system_fingerprint``, ...) and vLLM's
(``stop_reason``, ``prompt_logprobs``, ``token_ids``, ...), null where burstgate has nothing to say.
Streams follow vLLM's serving code: one opening chunk per choice with the assistant role, a chunk per
engine chunk (chat skips those with nothing to show; text completions send every token), the finish
reason once per choice, usage on every chunk with ``continuous_usage_stats`` and in a last chunk with
``include_usage``.
"""

from __future__ import annotations

import collections
import json
import time
from typing import Any

from backends.base import GenerationChunk, TokenLogprob, ToolCallDelta, Usage

SYSTEM_FINGERPRINT = "burstgate-0.1.0"


def _floor(logprob: float) -> float:
    """-inf as vLLM writes it (JSON has no infinity)."""
    return max(logprob, -9999.0)


def usage_dict(usage: Usage | None, details: bool = True) -> dict | None:
    if usage is None:
        return None
    out: dict[str, Any] = {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.total_tokens,
                           "completion_tokens": usage.completion_tokens}
    if details:
        out["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens} if usage.cached_tokens else None
        out["completion_tokens_details"] = None
    return out


def _finish(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


def _token_entry(token: str, logprob: float | None) -> dict:
    return {"token": token, "logprob": None if logprob is None else _floor(logprob), "bytes": list(token.encode("utf-8", "replace"))}


def chat_logprobs(lps: list[TokenLogprob] | None, top_k: int) -> dict | None:
    """``top`` lists the token itself first (vLLM's order); chat shows the first ``top_k`` entries."""
    if lps is None:
        return None
    return {"content": [{**_token_entry(lp.token, lp.logprob),
                         "top_logprobs": [_token_entry(t, l) for _, t, l in lp.top[:top_k]]} for lp in lps]}


def completion_logprobs(lps: list[TokenLogprob] | None, text_offset: int = 0) -> dict | None:
    """Text completions show every alternative (the token and up to ``logprobs`` others, as vLLM does)."""
    if lps is None:
        return None
    offsets, pos = [], text_offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return {"text_offset": offsets,
            "token_logprobs": [None if lp.logprob is None else _floor(lp.logprob) for lp in lps],
            "tokens": [lp.token for lp in lps],
            "top_logprobs": [None if lp.logprob is None else {t: _floor(l) for _, t, l in lp.top}
                             for lp in lps]}


def prompt_logprobs(entries: list[TokenLogprob | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token, ``{token_id: {logprob, rank, decoded_token}}`` for the
    token and its alternatives (ranked 1, 2, ...), None for the first token."""
    if entries is None:
        return None
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranks = {e.token_id: e.rank}
        ranks.update((t, r) for r, (t, _, _) in enumerate([x for x in e.top if x[0] != e.token_id], start=1)
                     if t not in ranks)
        out.append({str(t): {"logprob": _floor(l), "rank": ranks[t], "decoded_token": text}
                    for t, text, l in e.top})
    return out


def tool_calls_full(calls: list[ToolCallDelta] | None) -> list[dict] | None:
    """Folded tool calls as a message carries them; arguments re-serialised as vLLM's parsers return them."""
    if not calls:
        return None
    out = []
    for c in sorted(calls, key=lambda c: c.index):
        try:
            arguments = json.dumps(json.loads(c.arguments), ensure_ascii=False)
        except ValueError:
            arguments = c.arguments  # cut off (max_tokens): as generated
        out.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}})
    return out


def tool_calls_delta(calls: list[ToolCallDelta]) -> list[dict]:
    out = []
    for c in calls:
        if c.id is not None:  # the first piece of a call: its id and name
            out.append({"id": c.id, "type": "function", "index": c.index, "function": {"name": c.name}})
        else:
            out.append({"index": c.index, "function": {"arguments": c.arguments}})
    return out


class ResponseWriter:
    """Builds the response objects of one request, chat or text-completion flavoured, for ``n_choices``
    choices (``top_logprobs``: alternatives a chat choice shows per token)."""

    def __init__(self, request_id: str, model: str, chat: bool, n_choices: int = 1, top_logprobs: int = 0,
                 include_usage: bool = False, continuous_usage: bool = False) -> None:
        self.id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.n_choices, self.top_logprobs = n_choices, top_logprobs
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage  # vLLM: only with include_usage
        # per choice, filled as choices arrive: nothing is sized by a request's n before the backend has bounded it
        self._text_offset: dict[int, int] = collections.defaultdict(int)
        self._tokens: dict[int, int] = collections.defaultdict(int)  # generated per choice, for continuous usage
        self._prompt_tokens = 0

    # -------------------------------------------------------------------------------------- whole
    def full(self, choices: list[GenerationChunk], usage: Usage | None) -> dict:
        """The whole answer from each choice's folded chunks (``GenerationChunk.extend``)."""
        if self.chat:
            body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                    "choices": [self._chat_choice(c) for c in choices], "service_tier": None,
                    "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage_dict(usage),
                    "prompt_logprobs": prompt_logprobs(choices[0].prompt_logprobs) if choices else None,
                    "prompt_token_ids": None, "prompt_text": None}
        else:
            body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                    "choices": [self._completion_choice(c) for c in choices], "service_tier": None,
                    "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage_dict(usage)}
        return {**body, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}

    def _chat_choice(self, c: GenerationChunk) -> dict:
        calls = tool_calls_full(c.tool_calls)
        message: dict[str, Any] = {"role": "assistant", "content": None if calls and not c.text else c.text, "refusal": None,
                   "annotations": None, "audio": None, "function_call": None}
        if calls:
            message["tool_calls"] = calls
        message["reasoning"] = None
        return {"index": c.index, "message": message, "logprobs": chat_logprobs(c.logprobs, self.top_logprobs),
                "finish_reason": _finish(c.finish_reason), "stop_reason": c.stop_reason, "token_ids": None,
                "routed_experts": None}

    def _completion_choice(self, c: GenerationChunk) -> dict:
        return {"index": c.index, "text": c.text, "logprobs": completion_logprobs(c.logprobs),
                "finish_reason": _finish(c.finish_reason), "stop_reason": c.stop_reason, "token_ids": None,
                "prompt_logprobs": prompt_logprobs(c.prompt_logprobs), "prompt_token_ids": None,
                "routed_experts": None}

    # ------------------------------------------------------------------------------------ stream
    def _event(self, body: dict) -> bytes:
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def _head(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}

    def _running_usage(self, index: int | None) -> dict:
        completion = 0 if index is None else self._tokens[index]
        out: dict[str, Any] = {"prompt_tokens": self._prompt_tokens, "total_tokens": self._prompt_tokens + completion,
                               "completion_tokens": completion}
        if self.chat:
            out["completion_tokens_details"] = None
        return out

    def opening_events(self, first: GenerationChunk | None) -> list[bytes]:
        """Chat streams open with the assistant role, one chunk per choice, as vLLM's do."""
        if first is not None and first.usage is not None:
            self._prompt_tokens = first.usage.prompt_tokens
        if not self.chat:
            return []
        events = []
        for i in range(self.n_choices):
            body = self._head([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])
            if self.continuous_usage:
                body["usage"] = self._running_usage(None)
            events.append(self._event({**body, "prompt_token_ids": None, "prompt_text": None}))
        return events

    def chunk_event(self, chunk: GenerationChunk) -> bytes | None:
        """The event of one chunk (None: a chat chunk with nothing to show, skipped as vLLM skips it)."""
        i = chunk.index
        self._tokens[i] += len(chunk.token_ids)
        if chunk.usage is not None:
            self._prompt_tokens = chunk.usage.prompt_tokens
        if self.chat:
            if not (chunk.text or chunk.tool_calls or chunk.logprobs or chunk.finish_reason):
                return None  # e.g. a token held back while it may begin a stop string
            delta: dict = {}
            if chunk.tool_calls:
                delta = {"content": chunk.text or None, "tool_calls": tool_calls_delta(chunk.tool_calls)}
            elif chunk.text:
                delta = {"content": chunk.text}
            choice = {"index": i, "delta": delta, "logprobs": chat_logprobs(chunk.logprobs, self.top_logprobs),
                      "finish_reason": _finish(chunk.finish_reason)}
        else:
            logprobs = completion_logprobs(chunk.logprobs, self._text_offset[i])
            if logprobs and logprobs["tokens"]:  # vLLM advances by the tokens reported, not the text
                self._text_offset[i] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            choice = {"index": i, "text": chunk.text, "logprobs": logprobs, "finish_reason": _finish(chunk.finish_reason)}
        if chunk.finish_reason is not None or not self.chat:
            choice["stop_reason"] = chunk.stop_reason
        if not self.chat:
            choice["prompt_token_ids"] = None
        choice["token_ids"] = None
        body = self._head([choice])
        if chunk.finish_reason is not None and not self.include_usage:
            body["system_fingerprint"] = SYSTEM_FINGERPRINT
        if self.continuous_usage:
            body["usage"] = self._running_usage(i)
        return self._event(body)

    def usage_event(self, usage: Usage | None) -> bytes:
        """The extra last chunk of ``stream_options.include_usage``: no choices, the request's usage."""
        body = self._head([])
        body["usage"] = {k: v for k, v in (usage_dict(usage) or {}).items() if v is not None}
        body["system_fingerprint"] = SYSTEM_FINGERPRINT
        return self._event(body)


DONE = b"data: [DONE]\n\n"
