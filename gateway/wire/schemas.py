"""The gateway's answers as pydantic models, for its OpenAPI document only.

The routes build plain dicts (gateway/wire/encoding.py) and never validate them at run time (that would
cost every request); the fuzz suite (tests/gateway/test_schemathesis.py) checks every answer against
these schemas instead.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

FinishReason = Literal["stop", "length"] | None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every failure, in OpenAI's shape."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class RenderedRequest(BaseModel):
    """vLLM's ``GenerateRequest``: a request as the engine gets it (gateway/wire/render.py)."""

    request_id: str
    token_ids: list[int]
    token_offsets: None
    features: None
    content_parts: None
    sampling_params: dict[str, Any]
    model: str
    reasoning_ended: None
    reasoning_parser_kwargs: None
    return_token_ids: None
    output_mode: Literal["tokens"]
    stream: bool
    stream_options: None
    cache_salt: None
    priority: int
    kv_transfer_params: None
    ec_transfer_params: None


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    ready: bool
    models: dict[str, bool]
    draining: bool  # told to stop: finishing what it serves (gateway/drain.py)


class DeploymentState(BaseModel):
    name: str
    backend: str
    healthy: bool
    weight: float
    breaker: Literal["closed", "open", "half_open"]
    consecutive_failures: int
    in_flight: int
    waiting: int
    ttft_ewma_ms: float | None


class ModelState(BaseModel):
    name: str
    routing: str
    fallbacks: list[str]
    deployments: list[DeploymentState]


class Backends(BaseModel):
    models: list[ModelState]


class Device(BaseModel):
    kind: str
    name: str
    count: int
    memory_bytes: int


class DeploymentInfo(BaseModel):
    name: str
    kind: str
    settings: dict[str, Any]
    engine: dict[str, Any] | None = None


class ModelInfo(BaseModel):
    name: str
    routing: str
    deployments: list[DeploymentInfo]


class ServerInfo(BaseModel):
    server: Literal["burstgate"]
    version: str | None
    hardware: str
    devices: list[Device]
    gpu_memory_used_bytes: list[int]  # by GPU index, when the request was answered
    models: list[ModelInfo]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class Response(BaseModel):
    """A Responses API response (gateway/responses/encoding.py writes every key of OpenAI's)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    metadata: dict[str, str]


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class InputItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries: each status answered with ``ErrorResponse``."""
    return {status: {"model": ErrorResponse} for status in statuses}


# Every route can answer these: bad framing, a body over the limit, a missing key, an unexpected failure.
COMMON = errors(400, 401, 413, 500)


def ok(model: type[BaseModel], *error_statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's answers: ``model`` with 200, ``ErrorResponse`` with the common and the given statuses."""
    return {200: {"model": model}, **COMMON, **errors(*error_statuses)}


CHUNK_EVENTS = ("JSON, or with `stream: true` Server-Sent Events whose data are chunk objects (an error object if "
                "the stream fails), then `[DONE]`.")
RESPONSE_EVENTS = ("JSON, or with `stream: true` the Responses API's typed Server-Sent Events (`response.created` "
                   "... `response.completed`, or `response.failed` if the stream fails).")


def generation(model: type[BaseModel], events: str = CHUNK_EVENTS) -> dict[int | str, dict[str, Any]]:
    """A generation route's answers: ``model`` as JSON, or Server-Sent Events with ``stream: true``."""
    return {200: {"model": model, "content": {"text/event-stream": {}}, "description": events},
            **COMMON, **errors(404, 429, 502, 503, 504)}
