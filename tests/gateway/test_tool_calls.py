"""Tool calling through the gateway with the real openai SDK, on a native deployment with ``tool_parser: hermes``
and the ChatML tools template (configs/chat_templates/chatml_tools.jinja): tools rendered by the template,
"required" and named choices forced by the grammar, "auto" parsed from the text, OpenAI's message and
stream shapes (vLLM's: vllm/entrypoints/openai/chat_completion/serving.py), and the round trip
call → tool message → answer, streamed and not."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from backends.native.config import EngineConfig
from tests.conftest import MODEL

TEMPLATE = str(Path(__file__).resolve().parents[2] / "configs" / "chat_templates" / "chatml_tools.jinja")
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER_SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time",
                                           "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL_REGEX = ('Checking\\. <tool_call>\\n\\{"name": "get_weather", "arguments": '
              '\\{"city": "Paris", "unit": "celsius"\\}\\}\\n</tool_call>')


@pytest.fixture(scope="module")
def served(start_gateway):
    with start_gateway(backend_config=EngineConfig(tool_parser="hermes", chat_template=TEMPLATE)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def _stream_calls(stream) -> tuple[str, dict[int, dict], str]:
    """Fold a streamed answer as a client does: content, tool calls by index, the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    call["id"], call["name"] = d.id, d.function.name
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_tools_are_rendered_by_the_chat_template(served):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    ids = httpx.post(f"{served}/tokenize", json={"model": MODEL, "messages": history, "tools": TOOLS}).json()["tokens"]
    text = httpx.post(f"{served}/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert "<tools>" in text and '"name": "get_weather"' in text and "Current time" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text


def test_required_forces_a_schema_valid_call(client, engine_idle):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=80, temperature=0, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)


def test_a_named_function_is_called_and_ends_with_stop(client, engine_idle):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's reason for a named choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)


def test_required_streamed_as_openai_streams_tool_call_deltas(client, engine_idle):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            stream=True)
    content, calls, finish = _stream_calls(stream)
    assert content == "" and finish == "stop"
    (call,) = calls.values()
    assert call["id"].startswith("chatcmpl-tool-") and call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_calls_out_of_the_text(client, stream, engine_idle):
    """The model's text is forced (a regex) to contain a hermes call after some content: "auto" finds it."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"regex": CALL_REGEX}})
    if stream:
        content, calls, finish = _stream_calls(client.chat.completions.create(stream=True, **kw))
        calls = [{"name": c["name"], "arguments": c["arguments"]} for c in calls.values()]
    else:
        r = client.chat.completions.create(**kw)
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in r.choices[0].message.tool_calls]
    assert content == "Checking. " and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather",
                                                                          {"city": "Paris", "unit": "celsius"})]


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip_call_then_tool_result_then_answer(client, stream, engine_idle):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    history = ASK + [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 degrees, sunny"}]
    kw = dict(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0)
    if stream:
        content, calls, finish = _stream_calls(client.chat.completions.create(stream=True, **kw))
    else:
        answer = client.chat.completions.create(**kw).choices[0]
        content, calls, finish = answer.message.content, answer.message.tool_calls, answer.finish_reason
    assert content and not calls and finish in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
])
def test_bad_tool_requests_get_a_400_naming_the_field(served, engine_idle, body, param):
    r = httpx.post(f"{served}/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ------------------------------------------------------------------------------- without a tool_parser
def test_without_a_parser_named_and_required_calls_are_forced_as_json(gateway_url, engine_idle):
    """vLLM serves forced calls without --enable-auto-tool-choice: the answer is held to JSON and read back as
    the calls it is (LangChain's ``bind_tools(tool_choice="any")`` and ``with_structured_output(method=
    "function_calling")`` send these); only "auto" needs the model's own format."""
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0)
        named = c.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
        (call,) = named.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and named.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
        required = c.chat.completions.create(tool_choice="required", **kw)
        calls = required.choices[0].message.tool_calls
        assert calls and required.choices[0].finish_reason == "tool_calls"
        assert all(call.function.name in ("get_weather", "get_time") for call in calls)
        with pytest.raises(openai.BadRequestError, match="requires a tool_parser"):
            c.chat.completions.create(tool_choice="auto", **kw)


def test_the_embedded_defaults_settings_serve_auto_tool_choice(start_gateway, engine_idle):
    """The default deployment (gateway.config.embedded_default) renders tools with SmolLM2's template and reads
    calls with the hermes parser: "auto" is answered, not refused."""
    from gateway.config import embedded_default

    default = embedded_default()
    config = EngineConfig(tool_parser=default.tool_parser, chat_template=default.chat_template)
    with start_gateway(backend_config=config) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 40, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
