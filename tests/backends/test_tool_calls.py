"""The tool-call parsers, fed text as an engine streams it (the formats of vLLM's hermes and llama3_json parsers:
vllm/tool_parsers/hermes_tool_parser.py, llama_tool_parser.py, and the JSON of forced calls on a deployment without
a parser, vllm/entrypoints/openai/chat_completion/serving.py), and the grammar that forces a call."""

from __future__ import annotations

import json

import pytest

from backends.base import GenerationChunk
from backends.tool_calls import (
    FORCED_JSON,
    HermesParser,
    Llama3JsonParser,
    NamedJsonParser,
    RequiredJsonParser,
    call_format,
    check_tool_request,
    tool_call_grammar,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _run(parser, pieces: list[str]) -> tuple[str, list[dict]]:
    """Feed ``pieces``; fold what comes out as a client would (content, calls by index)."""
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        text, deltas = parser.feed(piece, final=k == len(pieces) - 1)
        content += text
        for d in deltas:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id is not None:
                assert call["id"] is None, "a call is named once"
                call["id"], call["name"] = d.id, d.name
            call["arguments"] += d.arguments
    return content, [calls[i] for i in sorted(calls)]


def _chars(text: str) -> list[str]:
    return list(text)


@pytest.mark.parametrize("split", [_chars, lambda t: [t], lambda t: [t[i:i + 5] for i in range(0, len(t), 5)]])
def test_hermes_content_then_calls_in_any_split(split):
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = _run(HermesParser(), split(text))
    assert content == "Let me check. "
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"} and json.loads(calls[1]["arguments"]) == {}
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)


def test_hermes_holds_back_a_partial_tag_and_releases_it_at_the_end():
    p = HermesParser()
    assert p.feed("Hello <tool") == ("Hello ", [])
    assert p.feed("box", final=True) == ("<toolbox", [])
    assert not p.called


def test_hermes_streams_arguments_as_they_grow():
    p = HermesParser()
    p.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    _, deltas = p.feed('ty": "Ro')
    assert [d.arguments for d in deltas] == ['ty": "Ro']
    _, deltas = p.feed('me"}}</tool_call>', final=True)
    assert "".join(d.arguments for d in deltas) == 'me"}'


@pytest.mark.parametrize("split", [_chars, lambda t: [t]])
def test_llama3_json_calls_separated_by_semicolons(split):
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    content, calls = _run(Llama3JsonParser(), split(text))
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Oslo"}),
                                                                         ("get_time", {})]


def test_llama3_json_plain_text_is_content():
    assert _run(Llama3JsonParser(), _chars("Just text, no call."))[0] == "Just text, no call."


def test_the_forced_grammar_is_built_per_choice():
    assert tool_call_grammar("hermes", [WEATHER], "none", True) is None
    assert tool_call_grammar("hermes", [WEATHER], "auto", True) is None  # no strict tool: free text
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    assert tool_call_grammar("hermes", [strict], "auto", True).kind == "structural_tag"
    named = tool_call_grammar("llama3_json", [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                              True)
    tag = json.loads(named.spec)
    assert tag["format"]["stop_after_first"] and [t["begin"] for t in tag["format"]["tags"]] == [
        '{"name": "get_time", "parameters": ']
    assert named.param == "tool_choice"


async def _aiter(chunks):
    for c in chunks:
        yield c


def test_parse_tool_calls_sets_the_finish_reason():
    import asyncio

    from backends.tool_calls import parse_tool_calls

    async def run(choice):
        chunks = [GenerationChunk('<tool_call>{"name": "get_time", "arguments": {}}'),
                  GenerationChunk("</tool_call>", finish_reason="stop")]
        return [c async for c in parse_tool_calls(_aiter(chunks), "hermes", choice)]

    assert asyncio.run(run("required"))[-1].finish_reason == "tool_calls"
    assert asyncio.run(run({"type": "function", "function": {"name": "get_time"}}))[-1].finish_reason == "stop"


# ------------------------------------------------------------------------------- without a tool_parser
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


def test_without_a_parser_forced_calls_are_json_and_auto_is_refused():
    assert call_format(None, "required") == call_format(None, NAMED_TIME) == FORCED_JSON
    assert call_format("hermes", "required") == "hermes" and call_format(None, "auto") is None
    check_tool_request(None, [WEATHER], "required", None)
    check_tool_request(None, [WEATHER], NAMED_TIME, None)
    with pytest.raises(Exception, match='"auto" tool choice requires a tool_parser'):
        check_tool_request(None, [WEATHER], "auto", None)


@pytest.mark.parametrize("split", [_chars, lambda t: [t]])
def test_a_named_functions_answer_is_its_arguments(split):
    content, calls = _run(NamedJsonParser("get_weather"), split('{"city": "Paris"}'))
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("split", [_chars, lambda t: [t]])
def test_a_required_answer_is_a_list_of_calls(split):
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    content, calls = _run(RequiredJsonParser(), split(text))
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_forced_json_grammars_follow_the_functions_schemas():
    named = tool_call_grammar(FORCED_JSON, [WEATHER, TIME], NAMED_TIME, True)
    assert (named.kind, json.loads(named.spec)) == ("json", TIME["function"]["parameters"])
    required = json.loads(tool_call_grammar(FORCED_JSON, [WEATHER, TIME], "required", False).spec)
    assert required["minItems"] == required["maxItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert "maxItems" not in json.loads(tool_call_grammar(FORCED_JSON, [WEATHER], "required", True).spec)
