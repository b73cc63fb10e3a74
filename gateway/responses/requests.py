"""Responses API request bodies (OpenAI's shapes, vLLM's extra sampling fields) and their translation into the chat
request that serves them (and into the whole turn a server with its own /v1/responses is relayed).

Input items become chat messages: a message item by its role and text, ``function_call`` items the assistant's
``tool_calls`` (joined to the assistant message before them, as one chat turn), ``function_call_output`` items
``tool`` messages. ``instructions`` are a system message before the conversation (not carried to the next turn,
as OpenAI does). Fields are honoured, or refused with a 400 naming them: hosted tools, images and files,
reasoning, ``truncation: auto``, prompt templates and conversations have no engine behind them here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from backends.base import InvalidRequestError, random_id
from gateway.wire.requests import ChatCompletionRequest, Int64, StructuredOutputsParams, _Request

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Fields the gateway answers itself: a server the turn is relayed to gets the conversation whole, stores nothing
GATEWAY_FIELDS = {"model", "previous_response_id", "store", "background", "stream", "stream_options", "metadata"}
# Fields of OpenAI's request that no engine here can honour at any value but null
UNSUPPORTED = {"prompt": "prompt templates are not supported", "conversation": "conversations are not supported: "
               "continue one with previous_response_id", "max_tool_calls": "max_tool_calls is not supported"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# ------------------------------------------------------------------------------------------ input items
class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    """An earlier answer's text sent back as input (its annotations and logprobs are read and dropped)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    """A message: OpenAI's ``EasyInputMessage`` (no ``type`` needed, content a string) or a full message item."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[InputText | OutputText, Field(discriminator="type")]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def stored(self) -> dict[str, Any]:
        """The item as OpenAI lists it among a response's input items: an id, its text as content parts."""
        part = {"type": "output_text", "text": self.text(), "annotations": []} if self.role == "assistant" else {
            "type": "input_text", "text": self.text()}
        return {"id": self.id or f"msg_{random_id()}", "type": "message", "role": self.role, "content": [part],
                "status": self.status or "completed"}


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def stored(self) -> dict[str, Any]:
        return {**self.model_dump(exclude_none=True), "id": self.id or f"fc_{random_id()}",
                "status": self.status or "completed"}


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)

    def stored(self) -> dict[str, Any]:
        return {**self.model_dump(exclude_none=True), "id": self.id or f"fco_{random_id()}",
                "status": self.status or "completed"}


def _item_type(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_type)]


def chat_messages(items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem]) -> list[dict[str, Any]]:
    """``items`` as chat completion messages (the wire form ``ChatCompletionRequest`` reads)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def input_items_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (a stored conversation) as input items again: ``chat_messages`` read backwards."""
    items: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": message["tool_call_id"],
                          "output": message["content"]})
            continue
        calls = message.get("tool_calls") or []
        if message.get("content") is not None or not calls:
            items.append({"type": "message", "role": message["role"], "content": message.get("content") or ""})
        items += [{"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                   "arguments": call["function"]["arguments"]} for call in calls]
    return items


# ----------------------------------------------------------------------------------------- tools, text
class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced, strict or not (as vLLM does)


class TextConfig(_Strict):
    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
                      Field(discriminator="type")] | None = None
    verbosity: Literal["medium"] | None = None  # the model's own; asking for another is asking for nothing we can do

    def as_dict(self) -> dict[str, Any]:
        fmt = self.format.model_dump(by_alias=True, exclude_none=True) if self.format else {"type": "text"}
        return {"format": fmt, "verbosity": "medium"}


class Reasoning(_Strict):
    """Only null settings: the models served here have no reasoning to configure."""

    effort: None = None
    summary: None = None
    generate_summary: None = None


class StreamOptions(_Strict):
    include_obfuscation: Literal[False] = False  # events carry no padding (vLLM sends none either)


# -------------------------------------------------------------------------------------------- request
class ResponsesRequest(_Request):
    """``POST /v1/responses``: OpenAI's fields and vLLM's extra sampling fields; any other field is a 400."""

    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None  # an end-user id, as ``user``: it changes nothing in generation
    prompt_cache_key: str | None = None  # routes the request with the others of its key (a session)
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    truncation: Literal["disabled"] = "disabled"
    service_tier: Literal["auto", "default"] = "auto"
    reasoning: Reasoning | None = None
    # vLLM's extra sampling fields
    top_k: Int64 | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_nothing_here_does(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in UNSUPPORTED.items():
                if data.get(name) is not None:
                    raise InvalidRequestError(why, param=name)
        return data

    @model_validator(mode="after")
    def _vllm_rules(self) -> ResponsesRequest:
        if unknown := list(self.unknown_fields()):
            raise InvalidRequestError(f"Unknown field for /v1/responses: {unknown[0]}", param=unknown[0])
        if self.background and not self.store:
            raise InvalidRequestError("background can only be used when `store` is true", param="background")
        if self.background and self.stream:
            raise InvalidRequestError("background responses are not streamed here: poll "
                                      "GET /v1/responses/{id} instead", param="stream")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("Stream options can only be defined when `stream=True`.",
                                      param="stream_options")
        if self.text and self.text.format and self.text.format.type != "text" and self.structured_outputs:
            raise InvalidRequestError("Cannot specify both structured_outputs and text.format",
                                      param="structured_outputs")
        names = {t.name for t in self.tools}
        if not self.tools and self.tool_choice == "required":
            raise InvalidRequestError("Tool choice 'required' must be specified with 'tools' parameter.",
                                      param="tool_choice")
        if isinstance(self.tool_choice, FunctionToolChoice) and self.tool_choice.name not in names:
            raise InvalidRequestError("Tool choice 'function' not found in 'tools' parameter.", param="tool_choice")
        return self

    # --------------------------------------------------------------------------------- translation
    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """``tool_choice`` as the response echoes it: "auto" without tools is "none" (vLLM's rule)."""
        if isinstance(self.tool_choice, FunctionToolChoice):
            return self.tool_choice.model_dump()
        return "none" if not self.tools and self.tool_choice == "auto" else self.tool_choice

    def input_items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def relayed(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """This turn as a server with its own /v1/responses takes it: the fields the client set, less those the
        gateway answers itself, the conversation so far (``history``, as chat messages) before the input."""
        body = self.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude=GATEWAY_FIELDS)
        body["input"] = [*input_items_of(history),
                         *(item.model_dump(mode="json", exclude_none=True) for item in self.input_items())]
        return body

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request that serves this one after ``history`` (the earlier turns, as chat messages)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history
        messages += chat_messages(self.input_items())
        if not messages:
            raise InvalidRequestError("input must not be empty", param="input")
        choice = self.effective_tool_choice
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                      for t in self.tools] or None,
            "tool_choice": {"type": "function", "function": {"name": choice["name"]}} if isinstance(choice, dict)
            else choice,
            "parallel_tool_calls": self.parallel_tool_calls, "user": self.user,
            "logprobs": self.logprobs, "top_logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            "response_format": self._response_format(), "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0, "seed": self.seed, "stop": self.stop,
            "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
            "logit_bias": self.logit_bias,
            "structured_outputs": self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            if self.structured_outputs else None}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:  # an earlier turn's message the chat format refuses
            error = exc.errors()[0]
            where = ".".join(str(x) for x in error.get("loc", ()))
            raise InvalidRequestError(f"{where}: {error.get('msg')}", param="input") from None

    def _response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_,
                                                       "description": fmt.description, "strict": fmt.strict}}
