"""Tool calls for engines that generate text: the grammar that forces a call, and the parsers that turn the
generated text into OpenAI ``tool_calls``, incrementally, as vLLM's tool parsers do.

Formats (a deployment's ``tool_parser``, vLLM's ``--tool-call-parser`` names):
- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, after optional content
  (vllm/tool_parsers/hermes_tool_parser.py);
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` objects separated by ``;``,
  optionally after ``<|python_tag|>`` (vllm/tool_parsers/llama_tool_parser.py).

Without a parser (vLLM serves forced calls so too), "required" and a named function still work: the answer is
constrained to JSON, a named function's arguments object or a list of ``{"name", "parameters"}`` objects, and
read back as the calls it is (``FORCED_JSON``); only "auto" needs the model's own format.

``tool_choice`` "required" or a named function is enforced by an xgrammar structural tag in the parser's
own format whose arguments follow the function's JSON schema (vLLM builds the same tags in
vllm/tool_parsers/structural_tag_registry.py, constraining arguments when a tool is ``strict`` or the
server runs with ``--tool-strict-level parameter``; here they always are). "auto" is free text unless a
tool is ``strict``: then a call, once begun, must match its schema.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

from backends.base import GenerationChunk, InvalidRequestError, StructuredOutput, ToolCallDelta, ToolChoice, random_id

ToolParserName = Literal["hermes", "llama3_json"]


def tool_call_id() -> str:
    """A new call id, in vLLM's form."""
    return f"chatcmpl-tool-{random_id()[:16]}"


def named_function(tool_choice: ToolChoice) -> str | None:
    """The function a named ``tool_choice`` forces, or None."""
    return tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None


# ------------------------------------------------------------------------------------------ parsers
class ToolCallParser(abc.ABC):
    """Splits one choice's text, fed delta by delta, into content and tool-call pieces. Every call re-reads
    the whole text and sends what changed since the last (vLLM's parsers do the same)."""

    arguments_keys: tuple[str, ...] = ("arguments",)

    def __init__(self) -> None:
        self.text = ""
        self._content_sent = 0
        self._names: list[str] = []  # of calls whose first piece went out
        self._arguments: list[str] = []  # argument text sent per call

    @property
    def called(self) -> bool:
        return bool(self._names)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(content to send, tool-call pieces to send) once ``delta`` is added; ``final``: nothing follows."""
        self.text += delta
        content_end, calls = self._split(self.text, final)
        content = ""
        if content_end > self._content_sent:
            content, self._content_sent = self.text[self._content_sent:content_end], content_end
        pieces: list[ToolCallDelta] = []
        for i, (body, complete) in enumerate(calls):
            if i == len(self._names):
                name = re.search(r'"name"\s*:\s*"([^"]+)"', body)
                if name is None:
                    break  # the next call is not named yet: nothing after it can be sent
                self._names.append(name.group(1))
                self._arguments.append("")
                pieces.append(ToolCallDelta(i, tool_call_id(), name.group(1)))
            arguments = self._arguments_text(body, complete)
            if arguments and len(arguments) > len(self._arguments[i]) and arguments.startswith(self._arguments[i]):
                pieces.append(ToolCallDelta(i, arguments=arguments[len(self._arguments[i]):]))
                self._arguments[i] = arguments
        return content, pieces

    @abc.abstractmethod
    def _split(self, text: str, final: bool) -> tuple[int, list[tuple[str, bool]]]:
        """(end of the content that may be sent, [(JSON text of each call so far, whether it is complete)])."""

    def _arguments_text(self, body: str, complete: bool) -> str | None:
        """The text of a call's arguments object; the closing brace of the call itself cut once complete."""
        keys = "|".join(self.arguments_keys)
        match = re.search(rf'"(?:{keys})"\s*:\s*', body)
        if match is None:
            return None
        raw = body[match.end():]
        if complete:
            raw = raw.rstrip()
            raw = raw[:-1].rstrip() if raw.endswith("}") else raw
        return raw


class HermesParser(ToolCallParser):
    start, end = "<tool_call>", "</tool_call>"

    def _split(self, text: str, final: bool) -> tuple[int, list[tuple[str, bool]]]:
        first = text.find(self.start)
        if first == -1:  # hold back what may be the start of a tag
            return len(text) - (0 if final else _partial_overlap(text, self.start)), []
        calls, pos = [], first
        while (start := text.find(self.start, pos)) != -1:
            body_start = start + len(self.start)
            stop = text.find(self.end, body_start)
            if stop != -1:
                calls.append((text[body_start:stop].strip(), True))
                pos = stop + len(self.end)
                continue
            body = text[body_start:]
            body = body[:len(body) - _partial_overlap(body, self.end)].strip()
            calls.append((body, _is_json(body)))
            break
        return first, calls


class Llama3JsonParser(ToolCallParser):
    bot = "<|python_tag|>"
    arguments_keys = ("parameters", "arguments")

    def _split(self, text: str, final: bool) -> tuple[int, list[tuple[str, bool]]]:
        body = text.lstrip()
        if not final and self.bot.startswith(body):
            return 0, []  # whitespace or the start of the tag so far: undecided
        body = body.removeprefix(self.bot).lstrip()
        if not body:
            return (len(text) if final else 0), []
        if not body.startswith("{"):
            return len(text), []
        return 0, _json_calls(body, ";")


class RequiredJsonParser(ToolCallParser):
    """A forced answer without a parser: ``[{"name": ..., "parameters": {...}}, ...]`` (vLLM's schema)."""

    arguments_keys = ("parameters",)

    def _split(self, text: str, final: bool) -> tuple[int, list[tuple[str, bool]]]:
        return 0, _json_calls(text.lstrip().removeprefix("[").lstrip(), ",", closing="]")


class NamedJsonParser(ToolCallParser):
    """A named function forced without a parser: the whole answer is its arguments object."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _split(self, text: str, final: bool) -> tuple[int, list[tuple[str, bool]]]:
        complete = _is_json(text)
        body = f'{{"name": {json.dumps(self.name)}, "arguments": {text}{"}" if complete else ""}'
        return 0, [(body, complete)]


FORCED_JSON = "json"  # the parser of forced calls on a deployment without a tool_parser
PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def call_format(parser: str | None, tool_choice: ToolChoice) -> str | None:
    """How ``tool_choice``'s calls are written on a deployment with ``parser``: its format, else JSON for forced
    calls (None: "auto" without a parser, which ``check_tool_request`` refuses)."""
    if parser is not None:
        return parser
    return FORCED_JSON if tool_choice == "required" or named_function(tool_choice) else None


def _parser(fmt: str, tool_choice: ToolChoice) -> ToolCallParser:
    if fmt != FORCED_JSON:
        return PARSERS[fmt]()
    name = named_function(tool_choice)
    return NamedJsonParser(name) if name is not None else RequiredJsonParser()


def _json_calls(body: str, separator: str, closing: str | None = None) -> list[tuple[str, bool]]:
    """The JSON objects ``body`` begins with, one after another between ``separator``s (up to ``closing``): each
    call's text and whether it is complete (the last may be cut off)."""
    calls, decoder = [], json.JSONDecoder()
    while body and not (closing and body.startswith(closing)):
        try:
            _, end = decoder.raw_decode(body)
        except ValueError:
            calls.append((body, False))
            break
        calls.append((body[:end], True))
        body = body[end:].lstrip().removeprefix(separator).lstrip()
    return calls


def _partial_overlap(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def parse_tool_calls(chunks: AsyncIterator[GenerationChunk], parser: str, tool_choice: ToolChoice
                           ) -> AsyncGenerator[GenerationChunk, None]:
    """``chunks`` with each choice's text split into content and tool calls by ``parser``; a choice that
    called a tool ends with "tool_calls" (OpenAI's reason; "stop" when ``tool_choice`` named the function)."""
    parsers: dict[int, ToolCallParser] = {}
    forced_name = named_function(tool_choice)
    async for chunk in chunks:
        p = parsers.get(chunk.index) or parsers.setdefault(chunk.index, _parser(parser, tool_choice))
        content, calls = p.feed(chunk.text, final=chunk.finish_reason is not None)
        reason = chunk.finish_reason
        if reason == "stop" and p.called and forced_name is None:
            reason = "tool_calls"
        yield dataclasses.replace(chunk, text=content, tool_calls=calls or None, finish_reason=reason)


# ------------------------------------------------------------------------------------------ grammar
def tool_call_grammar(parser: str, tools: list[dict[str, Any]], tool_choice: ToolChoice,
                      parallel_tool_calls: bool) -> StructuredOutput | None:
    """The structural tag that forces ``tool_choice``'s calls in ``parser``'s format with schema-valid
    arguments ("required": one call or more, or exactly one without ``parallel_tool_calls``; a named
    function: one call of it), or that keeps calls of ``strict`` tools valid under "auto"; None when
    nothing is constrained."""
    from xgrammar.structural_tag import (
        JSONSchemaFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    functions = [t["function"] for t in tools]
    forced = named_function(tool_choice)
    if parser == FORCED_JSON:
        return _forced_json(functions, forced, parallel_tool_calls)
    if forced is not None:
        functions = [f for f in functions if f["name"] == forced]
    elif tool_choice == "auto":
        functions = [f for f in functions if f.get("strict")]
        if not functions:
            return None
    elif tool_choice != "required":
        return None
    if parser == "hermes":
        envelopes = [('<tool_call>\n{"name": "%s", "arguments": ', "}\n</tool_call>"),
                     ('<tool_call>{"name": "%s", "arguments": ', "}</tool_call>")]
        separator, trigger = "", "<tool_call>"
    else:
        envelopes = [('{"name": "%s", "parameters": ', "}")]
        separator, trigger = "; ", "{"
    tags = [TagFormat(begin=begin % f["name"], end=end,
                      content=JSONSchemaFormat(json_schema=f.get("parameters") or {"type": "object"}))
            for f in functions for begin, end in envelopes]
    if tool_choice == "auto":
        fmt = TriggeredTagsFormat(triggers=[trigger], tags=tags, stop_after_first=not parallel_tool_calls)
    else:
        fmt = TagsWithSeparatorFormat(tags=tags, separator=separator, at_least_one=True,
                                      stop_after_first=forced is not None or not parallel_tool_calls)
    return StructuredOutput("structural_tag", StructuralTag(format=fmt).model_dump_json(), "tool_choice")


def check_tool_request(parser: str | None, tools: list[dict[str, Any]] | None, tool_choice: ToolChoice,
                       structured: StructuredOutput | None) -> None:
    """Refuse what a deployment with ``parser`` (None: no tool calling) cannot do, in vLLM's words."""
    if tool_choice == "none" or not tools:
        return
    if parser is None and tool_choice == "auto":
        raise InvalidRequestError("\"auto\" tool choice requires a tool_parser on this deployment (vLLM: "
                                  "--enable-auto-tool-choice --tool-call-parser)", param="tool_choice")
    if parser is not None and parser not in PARSERS:
        raise InvalidRequestError(f"unknown tool_parser {parser!r}; known: {sorted(PARSERS)}", param="tool_choice")
    if tool_choice != "auto" and structured is not None:
        raise InvalidRequestError("You can only either use constraints for structured outputs or force tool "
                                  "calls, not both.", param=structured.param)


def _forced_json(functions: list[dict[str, Any]], forced: str | None, parallel_tool_calls: bool) -> StructuredOutput:
    """The JSON a forced call is written in without a parser (vLLM's): a named function's arguments, or a list of
    calls of any function, each ``{"name", "parameters"}`` (one call only without ``parallel_tool_calls``)."""
    if forced is not None:
        parameters = next(f for f in functions if f["name"] == forced).get("parameters") or {"type": "object"}
        return StructuredOutput("json", json.dumps(parameters), "tool_choice")
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                               "parameters": f.get("parameters") or {"type": "object"}},
              "required": ["name", "parameters"]} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutput("json", json.dumps(schema), "tool_choice")
