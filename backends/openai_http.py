"""Any OpenAI-compatible server: vLLM, SGLang, LightLLM's and MII's OpenAI servers, llama.cpp, burstgate.

Chat requests go to ``/chat/completions`` with the messages unchanged (the server owns the template);
prompts go to ``/completions``. Streamed requests are streamed upstream (with ``include_usage``) and
relayed chunk by chunk; closing our iterator closes the HTTP response, which vLLM and burstgate turn
into an abort. Non-streamed requests are fetched whole (one JSON instead of an SSE event per token).
vLLM's extra sampling fields are sent only when they differ from the defaults, so strict servers
never see them; every field the gateway does not interpret itself (``GenerationRequest.extra``) is
forwarded as the client sent it, for the server to honour or refuse. Structured outputs go as OpenAI's
``response_format`` when it can say them (JSON schema, JSON object) and as vLLM's ``structured_outputs``
otherwise; tools, ``n``, ``logit_bias``, ``echo`` and ``prompt_logprobs`` go as they are, and choices,
tool calls, stop reasons and prompt logprobs come back into the chunks.

A Responses API turn is relayed to the server's own ``/v1/responses`` where it has one (``responses_api``): the
gateway keeps what makes that API stateful (stored responses, ``previous_response_id``, background runs,
cancellation, routing to where the conversation is held), so the server gets each turn whole, the conversation in
its ``input``, streamed and with ``store: false``. Its typed events are read back into chunks (text deltas with
their logprobs, function calls and their argument deltas, the finish and usage of ``response.completed``): a
relayed answer goes through the same assembly, metrics, limits and retries as one served over chat completions
and looks the same to the client whichever deployment answered. Items the gateway's Responses API does not write
(reasoning) are not passed on.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

from backends.base import (
    Backend,
    BackendError,
    BackendInfo,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    OverloadedError,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
    ToolCallDelta,
    UnavailableError,
    UpstreamError,
    Usage,
)
from backends.http import DONE, HTTPClient, RemoteConfig, json_body, sse_events, transport_errors

ResponsesAPI = Literal["auto", "relay", "chat"]


class OpenAIHTTPBackend(Backend):
    def __init__(self, model_name: str, cfg: RemoteConfig, url: str | None = None,
                 responses_api: ResponsesAPI = "chat") -> None:
        """``url`` replaces ``cfg.url`` (a text server's OpenAI route beside its native one); ``responses_api``:
        how Responses API turns reach the server (relayed to its /v1/responses, over chat, or "auto": relayed
        where it has the route)."""
        url = url or cfg.url
        self.name = f"openai:{url}"
        self.base_url = url.rstrip("/")
        self.upstream_model = cfg.upstream_model or model_name
        self._http = HTTPClient(self.base_url, cfg, self.name)
        self._relays: bool | None = {"relay": True, "chat": False}.get(responses_api)  # None: not asked yet

    async def close(self) -> None:
        await self._http.close()

    # ----------------------------------------------------------------------------------- protocol
    async def stream(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        if request.responses is not None and await self.relays_responses():
            async for chunk in self._relay_responses(request.responses):
                yield chunk
            return
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
                for chunk in _whole(await r.read(), chat):
                    yield chunk

    async def health(self) -> bool:
        return await self._http.ok("/models")

    async def relays_responses(self) -> bool:
        """Whether Responses API turns go to the server's own /v1/responses: as configured, or as the server
        answers a GET there (405: the POST-only route exists; 404: it does not). Asked once; an answer that
        says neither (a proxy's error page) is not kept, and that turn goes over chat."""
        if self._relays is not None:
            return self._relays
        status = (await self._http.call("GET", "/responses", timeout_s=5.0)).status
        if status in (404, 405):
            self._relays = status == 405
        return status == 405

    async def _relay_responses(self, turn: dict[str, Any]) -> AsyncGenerator[GenerationChunk, None]:
        body = {**turn, "model": self.upstream_model, "stream": True, "store": False}
        async with transport_errors(self.name), self._http.stream("POST", "/responses", json=body) as r:
            if r.status != 200:
                raise _status_error(r.status, await r.read())
            async for chunk in _relayed_chunks(r):
                yield chunk

    async def info(self) -> BackendInfo:
        r = await self._http.call("GET", "/models", timeout_s=5.0)
        try:
            if r.status != 200:
                raise ValueError(f"status {r.status}")
            models = json.loads(r.content).get("data", [])
        except (ValueError, AttributeError) as exc:
            raise UnavailableError(f"{self.name}: cannot list models: {exc!r}") from exc
        mine: dict[str, Any] = next((m for m in models if m.get("id") == self.upstream_model), {})
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
        if request.tools is not None:
            body.update(tools=request.tools, tool_choice=request.tool_choice)
            if not request.parallel_tool_calls:
                body["parallel_tool_calls"] = False
        optional = {"echo": request.echo, "user": request.user}
        body.update({k: v for k, v in optional.items() if v})
        body.update(request.extra)
        return body


def _structured_fields(so: StructuredOutput) -> dict[str, Any]:
    """A constraint as OpenAI's ``response_format`` where it has a form, else as vLLM's ``structured_outputs``."""
    if so.kind == "json_object" and so.any_whitespace:
        return {"response_format": {"type": "json_object"}}
    if so.kind == "json" and so.any_whitespace:
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": so.name or "response", "schema": json.loads(so.spec), "strict": True}}}
    if so.kind == "structural_tag":
        return {"response_format": json.loads(so.spec)}
    if so.kind in ("json", "choice"):
        value: Any = json.loads(so.spec)
    else:
        value = True if so.kind == "json_object" else so.spec  # regex, grammar: the text itself
    fields: dict[str, Any] = {so.kind: value}
    if not so.any_whitespace:
        fields["disable_any_whitespace"] = True
    return {"structured_outputs": fields}


def _sampling_fields(p: SamplingParams, chat: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {"temperature": p.temperature, "top_p": p.top_p}
    if p.max_tokens is not None:
        fields["max_tokens"] = p.max_tokens
    optional: dict[str, tuple[Any, Any]] = {
        "seed": (p.seed, None), "stop": (p.stop, []), "presence_penalty": (p.presence_penalty, 0.0),
        "frequency_penalty": (p.frequency_penalty, 0.0), "top_k": (p.top_k, -1), "min_p": (p.min_p, 0.0),
        "repetition_penalty": (p.repetition_penalty, 1.0), "ignore_eos": (p.ignore_eos, False),
        "stop_token_ids": (p.stop_token_ids, []), "min_tokens": (p.min_tokens, 0),
        "skip_special_tokens": (p.skip_special_tokens, True),
    }
    fields.update({k: v for k, (v, default) in optional.items() if v != default})
    if p.n != 1:
        fields["n"] = p.n
    if p.logit_bias:
        fields["logit_bias"] = {str(token): bias for token, bias in p.logit_bias.items()}
    if p.prompt_logprobs is not None:
        fields["prompt_logprobs"] = p.prompt_logprobs
    if p.structured is not None:
        fields.update(_structured_fields(p.structured))
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
    pending: GenerationChunk | None = None  # the last finish chunk waits for the usage chunk that follows
    async for event in sse_events(response):
        if event == DONE:
            break
        if "error" in event:
            err = event["error"]
            raise UpstreamError(f"upstream error mid-stream: {err.get('message', err) if isinstance(err, dict) else err}")
        usage = _usage(event.get("usage"))
        for choice in event.get("choices") or []:
            chunk = _chunk(choice, chat, choice.get("delta") or {})
            if chunk.finish_reason is not None:
                if pending is not None:
                    yield pending
                finished, pending = True, chunk
                chunk.usage = usage
            elif chunk.text or chunk.logprobs or chunk.tool_calls:
                yield chunk
        if usage is not None and pending is not None:
            pending.usage = usage
    if pending is not None:
        yield pending
    if not finished:
        raise UpstreamError("upstream stream ended without a finish reason")


async def _relayed_chunks(response) -> AsyncGenerator[GenerationChunk, None]:
    """The chunks of a Responses API event stream; one that fails, or ends before its response does, raises."""
    calls = 0  # function calls opened so far: the open one's index is calls - 1
    async for event in sse_events(response):
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "response.output_text.delta":
            logprobs = event.get("logprobs")
            yield GenerationChunk(text=event.get("delta") or "",
                                  logprobs=_logprobs({"content": logprobs}, chat=True) if logprobs else None)
        elif kind == "response.output_item.added" and (item := event.get("item") or {}).get("type") == "function_call":
            calls += 1
            yield GenerationChunk(tool_calls=[ToolCallDelta(calls - 1, item.get("call_id"), item.get("name"),
                                                            item.get("arguments") or "")])
        elif kind == "response.function_call_arguments.delta" and calls:
            yield GenerationChunk(tool_calls=[ToolCallDelta(calls - 1, arguments=event.get("delta") or "")])
        elif kind in ("response.completed", "response.incomplete"):
            yield _relayed_end(event.get("response") or {}, calls)
            return
        elif kind in ("response.failed", "error"):
            error = (event.get("response") or {}).get("error") or event.get("error") or event
            message = error.get("message", error) if isinstance(error, dict) else error
            raise UpstreamError(f"upstream error mid-stream: {message}")
    raise UpstreamError("upstream stream ended before its response completed")


def _relayed_end(response: dict[str, Any], calls: int) -> GenerationChunk:
    """A relayed response's last chunk: why it ended (cut by ``max_output_tokens``, calls made, or done), usage."""
    reason: FinishReason = "length" if response.get("status") == "incomplete" else "tool_calls" if calls else "stop"
    u = response.get("usage")
    usage = Usage(u.get("input_tokens", 0), u.get("output_tokens", 0),
                  (u.get("input_tokens_details") or {}).get("cached_tokens") or 0) if u else None
    return GenerationChunk(finish_reason=reason, usage=usage)


def _whole(content: bytes, chat: bool) -> list[GenerationChunk]:
    """A non-streamed reply as one final chunk per choice, the usage on the last."""
    reply = json_body(content)
    try:
        choices = list(reply["choices"])
        chunks = [_chunk(choice, chat, choice.get("message") or {}) for choice in choices]
    except (KeyError, TypeError, AttributeError) as exc:
        raise UpstreamError(f"malformed reply from upstream: {content[:200]!r}") from exc
    if not chunks or any(c.finish_reason is None for c in chunks):
        raise UpstreamError("upstream reply has no finish_reason")
    if chat and reply.get("prompt_logprobs") is not None:
        chunks[0].prompt_logprobs = _prompt_logprobs(reply["prompt_logprobs"])
    chunks[-1].usage = _usage(reply.get("usage"))
    return chunks


def _chunk(choice: dict, chat: bool, message: dict) -> GenerationChunk:
    """A choice of a reply (``message``: its message) or of a stream event (``message``: its delta)."""
    text = (message.get("content") or "") if chat else choice.get("text") or ""
    reason = choice.get("finish_reason")
    if reason is not None and reason not in ("stop", "length", "tool_calls"):
        reason = "stop"  # e.g. content_filter / eos_token: the answer ended normally
    calls = [ToolCallDelta(c.get("index", k), c.get("id"), (c.get("function") or {}).get("name"),
                           (c.get("function") or {}).get("arguments") or "")
             for k, c in enumerate(message.get("tool_calls") or [])] if chat else []
    return GenerationChunk(text=text, logprobs=_logprobs(choice.get("logprobs"), chat), finish_reason=reason,
                           index=choice.get("index", 0), stop_reason=choice.get("stop_reason"),
                           tool_calls=calls or None,
                           prompt_logprobs=_prompt_logprobs(choice.get("prompt_logprobs")))


def _prompt_logprobs(entries: list | None) -> list[TokenLogprob | None] | None:
    """vLLM's ``prompt_logprobs`` (per token ``{id: {logprob, rank, decoded_token}}``, the token first)."""
    if entries is None:
        return None
    out: list[TokenLogprob | None] = []
    for entry in entries:
        if not entry:
            out.append(None)
            continue
        top = [(int(t), e.get("decoded_token") or "", e["logprob"]) for t, e in entry.items()]
        first = next(iter(entry.values()))
        out.append(TokenLogprob(top[0][0], top[0][1], top[0][2], top, first.get("rank")))
    return out


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
            for tok, l, top in zip(lp.get("tokens", []), lp.get("token_logprobs", []), tops)]  # l: None when echoed
