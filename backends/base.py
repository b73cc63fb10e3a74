"""The contract between the gateway and every backend.

These are the only types that cross the line: the gateway builds a ``GenerationRequest``, a backend
answers with an async stream of ``GenerationChunk`` and signals trouble with a ``BackendError``
subclass. HTTP status codes for those errors are decided in one place, ``gateway/errors.py``.
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import AsyncGenerator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "tool_calls"]
SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS


# --------------------------------------------------------------------------------------------- errors
class BackendError(Exception):
    """Base of every error a backend raises; ``param`` names the offending request field, if any."""

    kind = "upstream_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(BackendError):
    """The request can never succeed as written (bad parameter, prompt too long, unknown token)."""

    kind = "invalid_request"


class OverloadedError(BackendError):
    """The backend's queue is full right now; retrying later may succeed."""

    kind = "overloaded"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after = retry_after


class UnavailableError(BackendError):
    """The backend cannot be reached or is not healthy."""

    kind = "unavailable"


class BackendTimeoutError(BackendError):
    """The backend did not answer within its deadline."""

    kind = "timeout"


class UpstreamError(BackendError):
    """The backend answered with a failure that is not the client's fault."""

    kind = "upstream_error"


# ----------------------------------------------------------------------------------- request / chunk
StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the form of the output (vLLM's ``StructuredOutputsParams``), enforced by a grammar.

    ``spec`` is the JSON schema (as JSON text) for ``json``, the pattern for ``regex``, the choices as a
    JSON list for ``choice``, the EBNF or Lark text for ``grammar``, xgrammar's structural tag as JSON
    for ``structural_tag`` (how tool calls are forced); ``json_object`` needs none. ``param`` is the
    request field it came from, named in errors; ``name`` the schema's name in ``response_format``.
    """

    kind: StructuredKind
    spec: str = ""
    param: str = "structured_outputs"
    any_whitespace: bool = True  # False: vLLM's disable_any_whitespace
    name: str | None = None


@dataclass
class SamplingParams:
    """Sampling settings with vLLM's meaning (``vllm.SamplingParams``)."""

    max_tokens: int | None = 16  # None: up to the model's context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # number of top alternatives to return per token; 0 = only the chosen
    skip_special_tokens: bool = True
    n: int = 1  # parallel samples of the prompt
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    prompt_logprobs: int | None = None  # top alternatives per prompt token (vLLM's prompt_logprobs)
    structured: StructuredOutput | None = None
    detokenize: bool = True  # vLLM's: False leaves the text out, token ids only (the virtual fleet's requests)

    MAX_LOGPROBS = 20

    def validate(self) -> None:
        """Raise ``InvalidRequestError`` naming the first invalid field (vLLM's checks and messages)."""
        checks: list[tuple[bool, str, str]] = [
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens}."),
            (_finite(self.temperature) and self.temperature >= 0, "temperature",
             f"temperature must be non-negative, got {self.temperature}."),
            (_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}."),
            (self.top_k >= -1, "top_k", f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}."),
            (_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}."),
            (_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
             f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."),
            (_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}."),
            (_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}."),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."),
            (self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS, "logprobs",
             f"logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs}."),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings."),
            (self.detokenize or not self.stop, "stop", "stop strings are only supported when detokenize is True"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be non-negative."),
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}."),
            (self.n == 1 or not self.greedy, "n", f"n must be 1 when using greedy sampling, got {self.n}."),
            (all(_finite(b) for b in self.logit_bias.values()), "logit_bias", "logit_bias values must be finite."),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS, "prompt_logprobs",
             f"prompt_logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.prompt_logprobs}."),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)

    @property
    def greedy(self) -> bool:
        """Temperatures under 1e-5 are greedy, as in vLLM (``SamplingParams.sampling_type``): dividing by
        them overflows the logits."""
        return self.temperature < SAMPLING_EPS


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# The X-Request-Id of the HTTP request being served (set by the gateway for the request's task and the
# tasks it starts): HTTP backends forward it upstream, so one id follows a request through every server.
REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)
# The W3C traceparent of the gateway's span for the call an HTTP backend is making, when tracing is on
# (gateway/tracing.py): set around the call, sent as a header so the server's spans join the trace.
TRACEPARENT: ContextVar[str | None] = ContextVar("traceparent", default=None)


def random_id() -> str:
    """32 random hex digits, like ``uuid.uuid4().hex`` (vLLM's request ids) at a fifth of its cost: one is made
    for every request, twice."""
    return os.urandom(16).hex()

ToolChoice = str | dict[str, Any]  # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}


@dataclass
class GenerationRequest:
    """One generation: either ``prompt`` (text or token ids) or chat ``messages``.

    ``tools`` are OpenAI function tools (rendered by the chat template, called as ``tool_choice`` says);
    ``echo`` puts the prompt before the output (text completions); ``extra`` holds the request fields the
    gateway does not interpret: a backend forwards them to a server that does, or refuses them.
    """

    request_id: str
    model: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    stream: bool = True  # a hint: the client wants chunks as they come (remote backends may fetch whole)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = "none"
    parallel_tool_calls: bool = True
    echo: bool = False
    user: str | None = None  # the client's end-user id: forwarded to OpenAI-style servers, changes no output
    extra: dict[str, Any] = field(default_factory=dict)
    # the Responses API request this one serves, whole (the conversation in its ``input``), for a server that
    # serves /v1/responses itself; the messages above say the same, for every other backend
    responses: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("exactly one of prompt or messages must be given", param="prompt")

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may call tools: then its call markers, which may be special tokens, are kept in the
        text for the parser (``skip_special_tokens`` off, as vLLM's parsers set it)."""
        return bool(self.tools) and self.tool_choice != "none"


@dataclass
class TokenLogprob:
    """A token's logprob with alternatives. ``top`` lists (token_id, token, logprob) in vLLM's order: the
    token itself first, then the most likely others; ``logprob`` is None for a prompt's first token."""

    token_id: int
    token: str
    logprob: float | None
    top: list[tuple[int, str, float]] = field(default_factory=list)
    rank: int | None = None  # 1 = most likely (prompt logprobs report it)


@dataclass
class ToolCallDelta:
    """A piece of a tool call as OpenAI streams it: the first piece of call ``index`` names it and carries
    its ``id``; later pieces carry fragments of its JSON ``arguments``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Usage:
    """Token counts of a whole request (every choice): prompt once, completions summed, as vLLM counts."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class GenerationChunk:
    """A piece of choice ``index`` of the answer. Each choice ends with a chunk carrying ``finish_reason``
    (and ``stop_reason``: the stop string or token id that ended it, as vLLM reports). ``usage`` is the
    request's running count: in-process engines put it on every chunk, every backend on its last one.
    ``prompt_logprobs`` (vLLM's, ``None`` for the first prompt token) come with a choice's first chunk."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    index: int = 0
    stop_reason: int | str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def extend(self, later: GenerationChunk) -> None:
        """Fold a later chunk of the same choice into this one (a whole answer from its chunks)."""
        self.text += later.text
        self.token_ids += later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        for delta in later.tool_calls or []:
            self._add_tool_call(delta)
        self.finish_reason = later.finish_reason or self.finish_reason
        self.stop_reason = later.stop_reason if later.finish_reason else self.stop_reason
        self.usage = later.usage or self.usage
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs

    def _add_tool_call(self, delta: ToolCallDelta) -> None:
        calls = self.tool_calls = self.tool_calls or []
        call = next((c for c in calls if c.index == delta.index), None)
        if call is None:
            calls.append(ToolCallDelta(delta.index, delta.id, delta.name, delta.arguments))
            return
        call.id, call.name = call.id or delta.id, call.name or delta.name
        call.arguments += delta.arguments


class UsageTally:
    """A request's usage from its chunks as they pass, also when it ends early (client gone, backend
    failed): the last usage a chunk carried, or the tokens counted so far when that is more."""

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.counted = 0  # generated tokens seen: token ids, or one per piece of text where there are none

    def add(self, chunk: GenerationChunk) -> None:
        self.counted += len(chunk.token_ids) or (1 if chunk.text or chunk.tool_calls else 0)
        if chunk.usage is not None:
            self.usage = chunk.usage

    def total(self) -> Usage:
        u = self.usage or Usage(0, 0)
        return Usage(u.prompt_tokens, max(u.completion_tokens, self.counted), u.cached_tokens)


@dataclass
class BackendInfo:
    """What a backend serves: model ids, context length, and its tokenizer's name if known."""

    model_ids: list[str]
    max_model_len: int | None = None
    tokenizer: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineStats:
    """Live load figures a backend may expose for metrics and routing."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


def refuse_extra_fields(request: GenerationRequest, server: str) -> None:
    """A 400 naming the first request field that ``server`` would not interpret (``request.extra``)."""
    for name in request.extra:
        raise InvalidRequestError(f"{name} is not supported by {server}", param=name)


_DEFAULTS = SamplingParams()
REQUEST_OPTIONS = ("tools", "echo")  # GenerationRequest fields a backend may list as unsupported


def refuse_unsupported(request: GenerationRequest, unsupported: tuple[str, ...], server: str) -> None:
    """A 400 naming the first field of ``request`` that ``server`` cannot honour: a ``SamplingParams`` field
    of ``unsupported`` set to anything but its default, tools or echo when listed, and any field the gateway
    did not interpret (``request.extra``). The field is named as the client sent it."""
    p = request.params
    for name in unsupported:
        used = bool(getattr(request, name)) if name in REQUEST_OPTIONS else getattr(p, name) != getattr(_DEFAULTS, name)
        if used:
            param = p.structured.param if name == "structured" and p.structured is not None else name
            raise InvalidRequestError(f"{param} is not supported by {server} backends", param=param)
    refuse_extra_fields(request, server)


# ---------------------------------------------------------------------------------------- protocol
class Backend(abc.ABC):
    """A model server the gateway can send generations to.

    ``stream`` is the only way to generate: closing or cancelling the returned iterator must abort the
    work on the backend. Non-streaming replies are the gateway folding the same stream.
    """

    name: str = "backend"

    async def start(self) -> None:  # noqa: B027 (a hook: backends without resources keep it empty)
        """Acquire resources (connections, engine threads). Called once before serving."""

    async def close(self) -> None:  # noqa: B027 (a hook, as start)
        """Release every resource; after this the backend serves nothing."""

    @abc.abstractmethod
    def stream(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Generate, yielding chunks as they are produced."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the backend can take requests now."""

    @abc.abstractmethod
    async def info(self) -> BackendInfo:
        """Model ids, context length and tokenizer of this backend."""

    async def tokenize(self, text: str | None = None, messages: list[dict[str, Any]] | None = None,
                       add_special_tokens: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids the backend would feed its model; backends without a tokenizer raise."""
        raise InvalidRequestError(f"backend {self.name!r} does not expose its tokenizer", param="model")

    async def detokenize(self, token_ids: list[int]) -> str:
        raise InvalidRequestError(f"backend {self.name!r} does not expose its tokenizer", param="model")

    def stats(self) -> EngineStats | None:
        """Live engine figures, for backends that run an engine in-process."""
        return None
