"""OpenAI wire format (plus vLLM's extra sampling fields): request models and their translation.

Requests are validated here; anything the backends cannot honour is refused with a 400 naming the
field, never silently dropped. Unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backends.base import InvalidRequestError, SamplingParams, StructuredOutput

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
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


class _Sampling(_Request):
    """Fields shared by chat and text completions, with OpenAI's and vLLM's names and defaults."""

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings are supported")
        return stops

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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
            structured=self.structured_output(),
        )
        params.validate()
        return params

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
        return _json_schema(rf.json_schema.schema_, "response_format", whitespace, rf.json_schema.name)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates expect it: content joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

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


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    def single_prompt(self) -> str | list[int]:
        """One prompt (text or token ids); batches of several prompts are refused."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidRequestError("only one prompt per request is supported", param="prompt")
            p = p[0]
        if isinstance(p, list) and not p:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return p

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)


class TokenizeRequest(_Request):
    """vLLM's /tokenize: either a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt or messages is required")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
