"""Any OpenAI-compatible server: vLLM, SGLang, LightLLM's and MII's OpenAI servers, llama.cpp, burstgate.

Chat requests go to ``/chat/completions`` with the messages unchanged (the server owns the template);
prompts go to ``/completions``. Streamed requests are streamed upstream (with ``include_usage``) and
relayed chunk by chunk; closing our iterator closes the HTTP response, which vLLM and burstgate turn
into an abort. Non-streamed requests are fetched whole (one JSON instead of an SSE event per token).
vLLM's extra sampling fields are sent only when they differ from the defaults, so strict servers
never see them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from backends.base import (
    Backend,
    BackendError,
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
from backends.http import DONE, HTTPClient, RemoteConfig, json_body, sse_events, transport_errors


class OpenAIHTTPBackend(Backend):
    def __init__(self, model_name: str, cfg: RemoteConfig, url: str | None = None) -> None:
        """``url`` replaces ``cfg.url`` (a text server's OpenAI route beside its native one)."""
        url = url or cfg.url
        self.name = f"openai:{url}"
        self.base_url = url.rstrip("/")
        self.upstream_model = cfg.upstream_model or model_name
        self._http = HTTPClient(self.base_url, cfg, self.name)

    async def close(self) -> None:
        await self._http.close()

    # ----------------------------------------------------------------------------------- protocol
    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        chat = request.messages is not None
        body = self._body(request, chat)
        path = "/chat/completions" if chat else "/completions"
        async with transport_errors(self.name), self._http.stream("POST", path, json=body) as r:
            if r.status != 200:
                raise _status_error(r.status, await r.read())
            if request.stream:
                async for chunk in _parse_sse(r, chat):
                    yield chunk
            else:
                yield _whole(await r.read(), chat)

    async def health(self) -> bool:
        return await self._http.ok("/models")

    async def info(self) -> BackendInfo:
        r = await self._http.call("GET", "/models", timeout_s=5.0)
        try:
            if r.status != 200:
                raise ValueError(f"status {r.status}")
            models = json.loads(r.content).get("data", [])
        except (ValueError, AttributeError) as exc:
            raise UnavailableError(f"{self.name}: cannot list models: {exc!r}") from exc
        mine = next((m for m in models if m.get("id") == self.upstream_model), {})
        return BackendInfo(model_ids=[m.get("id") for m in models], max_model_len=mine.get("max_model_len"))

    async def tokenize(self, text: str | None = None, messages: list[dict[str, Any]] | None = None,
                       add_special_tokens: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
        body = {"model": self.upstream_model, "add_special_tokens": add_special_tokens}
        body.update({"messages": messages} if messages is not None else {"prompt": text})
        if tools:
            body["tools"] = tools
        return (await self._root_post("/tokenize", body))["tokens"]

    async def detokenize(self, token_ids: list[int]) -> str:
        return (await self._root_post("/detokenize", {"model": self.upstream_model, "tokens": token_ids}))["prompt"]

    async def _root_post(self, path: str, body: dict) -> dict:
        """vLLM serves its tokenizer routes at the server root, beside /v1."""
        root = self.base_url.removesuffix("/v1")
        r = await self._http.call("POST", root + path, json=body)
        if r.status == 404:
            raise InvalidRequestError(f"{self.name} has no {path} route", param="model")
        if r.status != 200:
            raise _status_error(r.status, r.content)
        return json_body(r.content)

    # ------------------------------------------------------------------------------------ helpers
    def _body(self, request: GenerationRequest, chat: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.upstream_model, "stream": request.stream}
        if request.stream:
            body["stream_options"] = {"include_usage": True}
        if chat:
            body["messages"] = request.messages
        else:
            body["prompt"] = request.prompt
        body.update(_sampling_fields(request.params, chat))
        return body


def _sampling_fields(p: SamplingParams, chat: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {"temperature": p.temperature, "top_p": p.top_p}
    if p.max_tokens is not None:
        fields["max_tokens"] = p.max_tokens
    optional = {
        "seed": (p.seed, None), "stop": (p.stop, []), "presence_penalty": (p.presence_penalty, 0.0),
        "frequency_penalty": (p.frequency_penalty, 0.0), "top_k": (p.top_k, -1), "min_p": (p.min_p, 0.0),
        "repetition_penalty": (p.repetition_penalty, 1.0), "ignore_eos": (p.ignore_eos, False),
        "stop_token_ids": (p.stop_token_ids, []), "min_tokens": (p.min_tokens, 0),
        "skip_special_tokens": (p.skip_special_tokens, True),
    }
    fields.update({k: v for k, (v, default) in optional.items() if v != default})
    if p.logprobs is not None:
        if chat:
            fields.update(logprobs=True, top_logprobs=p.logprobs)
        else:
            fields["logprobs"] = p.logprobs
    return fields


def _status_error(status: int, content: bytes) -> BackendError:
    """An upstream HTTP failure as our error type; client errors stay client errors."""
    message, param = content.decode("utf-8", "replace")[:2000], None
    try:
        err = json.loads(content)
        err = err.get("error", err) if isinstance(err, dict) else err
        if isinstance(err, dict):
            message, param = err.get("message", message), err.get("param")
        elif isinstance(err, str):
            message = err
    except ValueError:
        pass
    if status in (400, 413, 422):
        return InvalidRequestError(message, param=param)
    if status == 429:
        return OverloadedError(f"upstream is overloaded: {message}")
    if status in (502, 503, 504):
        return UnavailableError(f"upstream answered {status}: {message}")
    return UpstreamError(f"upstream answered {status}: {message}", param=param)


async def _parse_sse(response, chat: bool) -> AsyncIterator[GenerationChunk]:
    finished = False
    pending: GenerationChunk | None = None  # the finish chunk waits for the usage chunk that follows it
    async for event in sse_events(response):
        if event == DONE:
            break
        if "error" in event:
            err = event["error"]
            raise UpstreamError(f"upstream error mid-stream: {err.get('message', err) if isinstance(err, dict) else err}")
        usage = _usage(event.get("usage"))
        for choice in event.get("choices") or []:
            chunk = _chunk(choice, chat)
            if chunk.finish_reason is not None:
                finished, pending = True, chunk
                chunk.usage = usage
            elif chunk.text or chunk.logprobs:
                yield chunk
        if usage is not None and pending is not None:
            pending.usage = usage
    if pending is not None:
        yield pending
    if not finished:
        raise UpstreamError("upstream stream ended without a finish reason")


def _whole(content: bytes, chat: bool) -> GenerationChunk:
    """A non-streamed reply as one final chunk."""
    reply = json_body(content)
    try:
        choice = reply["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise UpstreamError(f"malformed reply from upstream: {content[:200]!r}") from exc
    text = (choice.get("message") or {}).get("content") or "" if chat else choice.get("text") or ""
    chunk = _chunk({**choice, "delta": {"content": text}, "text": text}, chat)
    if chunk.finish_reason is None:
        raise UpstreamError("upstream reply has no finish_reason")
    chunk.usage = _usage(reply.get("usage"))
    return chunk


def _chunk(choice: dict, chat: bool) -> GenerationChunk:
    text = (choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or ""
    reason = choice.get("finish_reason")
    if reason is not None and reason not in ("stop", "length"):
        reason = "stop"  # e.g. tool_calls / content_filter / eos_token: the answer ended normally
    return GenerationChunk(text=text, logprobs=_logprobs(choice.get("logprobs"), chat), finish_reason=reason)


def _usage(u: dict | None) -> Usage | None:
    if not u:
        return None
    cached = ((u.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return Usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0), cached)


def _logprobs(lp: dict | None, chat: bool) -> list[TokenLogprob] | None:
    if not lp:
        return None
    if chat:
        return [TokenLogprob(-1, e["token"], e["logprob"], [(-1, t["token"], t["logprob"]) for t in e.get("top_logprobs", [])])
                for e in lp.get("content") or []]
    tops = lp.get("top_logprobs") or [{}] * len(lp.get("tokens", []))
    return [TokenLogprob(-1, tok, l, [(-1, t, v) for t, v in (top or {}).items()])
            for tok, l, top in zip(lp.get("tokens", []), lp.get("token_logprobs", []), tops)]
