"""OpenAI wire format (plus vLLM's extra fields): request models and their translation.

Requests are validated here, with vLLM's rules and messages where vLLM has them. Nothing is dropped: a
field the gateway does not know stays in ``GenerationRequest.extra``, which a backend forwards to a server
that honours it (the ``openai`` kind) or refuses with a 400 naming it; nested objects (messages, tools,
response formats) refuse unknown keys outright.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backends.base import GenerationRequest, InvalidRequestError, SamplingParams, StructuredOutput, ToolChoice

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
LOGIT_BIAS_LIMIT = 100.0  # OpenAI: "values between -100 and 100"; vLLM clamps to it


# Extensions the field's routers send on every request at their neutral values (SGLang's router and vLLM's:
# ``no_stop_trim: false``, ``return_hidden_states: false`` ...): at those values they ask for nothing, so they are
# honoured by doing nothing; at any other value they stay unknown fields (passed on to a server that takes them,
# refused with a 400 naming them elsewhere). SGLang's reasoning fields ask for nothing from a model without a
# reasoning parser, whatever their value.
NEUTRAL_EXTENSIONS: dict[str, tuple[Any, ...]] = {
    "no_stop_trim": (False,), "include_stop_str_in_output": (False,), "return_hidden_states": (False,),
    "continue_final_message": (False,), "separate_reasoning": (True, False), "stream_reasoning": (True, False),
    "include_reasoning": (True, False)}


class _Request(BaseModel):
    """A request body: fields the gateway does not know are kept (``model_extra``), never ignored."""

    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> dict[str, Any]:
        """The fields this gateway does not interpret, less the neutral extensions (``NEUTRAL_EXTENSIONS``)."""
        return {k: v for k, v in (self.model_extra or {}).items()
                if not (k in NEUTRAL_EXTENSIONS and any(v is n for n in NEUTRAL_EXTENSIONS[k]))}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not (as vLLM does)


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``, and vLLM's ``structural_tag`` form."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None  # of a structural tag

    @model_validator(mode="after")
    def _needs_its_part(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("When response_format type is 'json_schema', the 'json_schema' field must be provided.")
        if self.type == "structural_tag" and self.format is None:
            raise ValueError("A structural_tag response_format needs its 'format'.")
        return self


class StructuredOutputsParams(_Strict):
    """vLLM's ``structured_outputs``: one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def constraint(self) -> StructuredOutput | None:
        whitespace = not self.disable_any_whitespace
        found = [so for so in (
            _json_schema(self.json_, "structured_outputs", whitespace) if self.json_ is not None else None,
            StructuredOutput("regex", self.regex, "structured_outputs") if self.regex is not None else None,
            StructuredOutput("choice", json.dumps(self.choice), "structured_outputs") if self.choice else None,
            StructuredOutput("grammar", self.grammar, "structured_outputs") if self.grammar is not None else None,
            StructuredOutput("json_object", "", "structured_outputs", whitespace) if self.json_object else None,
        ) if so is not None]
        if len(found) > 1:
            raise InvalidRequestError("You can only use one kind of constraints for structured outputs "
                                      "('json', 'regex', 'choice', 'grammar' or 'json_object').",
                                      param="structured_outputs")
        return found[0] if found else None


def _json_schema(schema: dict[str, Any] | str, param: str, any_whitespace: bool = True,
                 name: str | None = None) -> StructuredOutput:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(f"{param}: the JSON schema is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param}: a JSON schema must be a JSON object", param=param)
    return StructuredOutput("json", json.dumps(schema), param, any_whitespace, name)


# ------------------------------------------------------------------------------------------- tools
class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule; the name is written into grammars
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def as_template_input(self) -> dict[str, Any]:
        """The tool as vLLM hands it to the chat template: description and parameters always (null when not
        given), strict only when set; the template writes it into the prompt, so this is the prompt vLLM makes."""
        f = self.function
        function = {"name": f.name, "description": f.description, "parameters": f.parameters}
        return {"type": self.type, "function": function | ({} if f.strict is None else {"strict": f.strict})}


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# ---------------------------------------------------------------------------------------- sampling
class _Sampling(_Request):
    """Fields shared by chat and text completions, with OpenAI's and vLLM's names and defaults."""

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id (OpenAI): it changes nothing in generation (neither in vLLM)
    # vLLM extras
    top_k: Int64 | None = None  # a tensor value in the sampler
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings are supported")
        return stops

    @model_validator(mode="after")
    def _vllm_rules(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("Stream options can only be defined when `stream=True`.",
                                      param="stream_options")
        if self.best_of not in (None, 1):  # vLLM's V1 engine removed it (vllm-project/vllm#29090)
            raise InvalidRequestError("best_of is not supported: ask for n samples instead.", param="best_of")
        if self.prompt_logprobs and self.stream:
            raise InvalidRequestError("`prompt_logprobs` are not available when `stream=True`.",
                                      param="prompt_logprobs")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            n=self.n,
            logit_bias=self._logit_bias(),
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            structured=self.structured_output(),
        )
        params.validate()
        return params

    def _logit_bias(self) -> dict[int, float]:
        """Token ids (JSON keys are strings) with their bias clamped to [-100, 100], as vLLM does."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise InvalidRequestError(f"logit_bias contains key(s) that cannot be converted to integer token "
                                          f"IDs: {[key]!r}", param="logit_bias") from None
            bias[token_id] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, value))
        return bias

    def structured_output(self) -> StructuredOutput | None:
        """The one output constraint the request asks for, whichever field carries it (400 if several)."""
        found = [so for so in (self._response_format(),
                               self.structured_outputs.constraint() if self.structured_outputs else None,
                               _json_schema(self.guided_json, "guided_json") if self.guided_json is not None else None,
                               StructuredOutput("regex", self.guided_regex, "guided_regex")
                               if self.guided_regex is not None else None,
                               StructuredOutput("choice", json.dumps(self.guided_choice), "guided_choice")
                               if self.guided_choice else None,
                               StructuredOutput("grammar", self.guided_grammar, "guided_grammar")
                               if self.guided_grammar is not None else None) if so is not None]
        if len(found) > 1:
            raise InvalidRequestError(f"Only one structured output constraint may be given, not {found[0].param} "
                                      f"and {found[1].param}.", param=found[1].param)
        return found[0] if found else None

    def _response_format(self) -> StructuredOutput | None:
        """``response_format``'s constraint, with ``structured_outputs``' options (vLLM applies it over them)."""
        rf = self.response_format
        whitespace = not (self.structured_outputs and self.structured_outputs.disable_any_whitespace)
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutput("json_object", "", "response_format", whitespace)
        if rf.type == "structural_tag":
            return StructuredOutput("structural_tag", json.dumps({"type": "structural_tag", "format": rf.format}),
                                    "response_format")
        schema = rf.json_schema
        assert schema is not None  # ResponseFormat's validator requires it for this type
        return _json_schema(schema.schema_, "response_format", whitespace, schema.name)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


# -------------------------------------------------------------------------------------------- chat
class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message of the history. Fields of OpenAI's response message that a client may send back are
    accepted when null (``refusal``, ``audio``, ...)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None
    reasoning: None = None
    reasoning_content: None = None

    @model_validator(mode="after")
    def _tool_fields_belong_to_their_roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates expect it: content joined into one string, tool call arguments as
        objects (vLLM passes them so, as HF templates read them)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidRequestError(f"tool call arguments must be JSON, got {text[:80]!r}", param="messages") from None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _logprobs_need_flag(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_input() for m in self.messages]

    def generation_request(self, request_id: str) -> GenerationRequest:
        """The request for a backend, tool settings checked with vLLM's rules and messages."""
        tools = [t.as_template_input() for t in self.tools] if self.tools is not None else None
        if tools == []:
            raise InvalidRequestError("`tools` must not be an empty array. Either provide at least one tool or "
                                      "omit the field entirely.", param="tools")
        named = self.tool_choice if isinstance(self.tool_choice, NamedToolChoice) else None
        choice: ToolChoice = self.tool_choice if isinstance(self.tool_choice, str) else ("auto" if tools else "none")
        if named is not None:
            if not any(t["function"]["name"] == named.function.name for t in tools or []):
                raise InvalidRequestError("The tool specified in `tool_choice` does not match any of the specified "
                                          "`tools`", param="tool_choice")
            choice = named.model_dump()
        elif choice != "none" and not tools:
            raise InvalidRequestError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        return GenerationRequest(request_id, self.model, self.to_sampling_params(), messages=self.template_messages(),
                                 stream=self.stream, tools=tools, tool_choice=choice,
                                 parallel_tool_calls=self.parallel_tool_calls, user=self.user,
                                 extra=self.unknown_fields())


# -------------------------------------------------------------------------------------- completions
class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    def prompts(self) -> list[str | list[int]]:
        """Each prompt (text or token ids) of the request; a list of several gets one choice each."""
        p = self.prompt
        prompts: list = list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        for one in prompts:
            if isinstance(one, list) and not one:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
        return prompts

    def to_sampling_params(self) -> SamplingParams:
        # vLLM: echo with logprobs reports the prompt's logprobs too (as prompt_logprobs)
        prompt_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else None
        return self.sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)

    def generation_requests(self, request_id: str) -> list[GenerationRequest]:
        """One request per prompt (ids ``<id>-<i>`` when there are several, as vLLM names them)."""
        prompts, params = self.prompts(), self.to_sampling_params()
        return [GenerationRequest(request_id if len(prompts) == 1 else f"{request_id}-{i}", self.model, params,
                                  prompt=prompt, stream=self.stream, echo=self.echo, user=self.user,
                                  extra=self.unknown_fields())
                for i, prompt in enumerate(prompts)]


# ---------------------------------------------------------------------------------------- tokenizer
class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: either a prompt or chat messages (with the tools the template renders)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt or messages is required")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]
