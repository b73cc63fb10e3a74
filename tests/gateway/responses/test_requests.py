"""A Responses request as the chat request that serves it: items to messages, tools, text formats, vLLM's sampling
fields; what nothing here can honour refused with a 400 naming it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from backends.base import InvalidRequestError
from gateway.responses.requests import ResponsesRequest, chat_messages, input_items_of

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def chat(history=(), **body):
    return ResponsesRequest(**{"model": "m", **body}).chat_request(list(history))


def test_a_string_input_is_one_user_message_after_the_instructions():
    c = chat(input="Hi", instructions="Be brief.")
    assert [m.model_dump(exclude_none=True) for m in c.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_items_become_chat_turns_calls_joined_to_the_assistant_message_before_them():
    c = chat(input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}], tools=[WEATHER])
    messages = c.template_messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]  # developer as system
    assert messages[2]["content"] == "Checking."
    assert messages[2]["tool_calls"] == [{"id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert messages[3] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}


def test_history_comes_between_the_instructions_and_the_new_input():
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    c = chat(history, input="And you?", instructions="Be brief.")
    assert [m.content for m in c.messages] == ["Be brief.", "Hi", "Hello!", "And you?"]


def test_a_stored_conversation_reads_back_as_the_items_it_came_from():
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "Let me look.", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
               {"role": "assistant", "content": None}]  # an empty answer stays a turn
    items = ResponsesRequest(model="m", input=input_items_of(history)).input_items()
    assert chat_messages(items) == [*history[:3], {"role": "assistant", "content": ""}]


def test_a_relayed_turn_carries_the_clients_fields_and_the_conversation_not_the_gateways_state():
    body = ResponsesRequest(model="m", input="And in Rome?", instructions="Be brief.", tools=[WEATHER], top_k=5,
                            previous_response_id="resp_1", store=True, stream=True, metadata={"a": "b"},
                            text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}})
    turn = body.relayed([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    assert turn == {"input": [{"type": "message", "role": "user", "content": "Hi"},
                              {"type": "message", "role": "assistant", "content": "Hello"},
                              {"type": "message", "role": "user", "content": "And in Rome?"}],
                    "instructions": "Be brief.", "tools": [{**WEATHER}], "top_k": 5,
                    "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}}


def test_sampling_tools_and_text_format_carry_over():
    c = chat(input="x", max_output_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop=["\n"],
             repetition_penalty=1.1, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
             parallel_tool_calls=False, user="u1",
             include=["message.output_text.logprobs"], top_logprobs=2)
    gen = c.generation_request("resp_1")
    p = gen.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.repetition_penalty) == (
        7, 0.5, 0.9, 5, 3, ["\n"], 1.1)
    assert p.logprobs == 2
    assert gen.tools[0]["function"]["name"] == "get_weather" and gen.parallel_tool_calls is False
    assert gen.tool_choice == {"type": "function", "function": {"name": "get_weather"}} and gen.user == "u1"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    so = chat(input="x", text={"format": {"type": "json_schema", "name": "thing", "schema": schema}}).structured_output()
    assert so.kind == "json" and so.param == "response_format"
    assert chat(input="x", text={"format": {"type": "json_object"}}).structured_output().kind == "json_object"
    assert chat(input="x", text={"format": {"type": "text"}}).structured_output() is None


def test_auto_without_tools_is_none_as_vllm_has_it():
    assert ResponsesRequest(model="m", input="x").effective_tool_choice == "none"
    assert chat(input="x").generation_request("r").tool_choice == "none"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({"input": "x", "text": {"verbosity": "high"}}, "text"),
    ({"input": "x", "stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_nothing_here_honours_is_a_validation_error_naming_it(body, param):
    with pytest.raises(ValidationError) as info:
        ResponsesRequest(model="m", **body)
    assert info.value.errors()[0]["loc"][0] == param


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"input": "x", "max_tool_calls": 3}, "max_tool_calls", "max_tool_calls"),
    ({"input": "x", "frobnicate": 1}, "frobnicate", "Unknown field"),
    ({"input": "x", "background": True, "store": False}, "background", "store"),
    ({"input": "x", "background": True, "stream": True}, "stream", "background"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options", "stream=True"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "'required' must be specified with 'tools'"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "not found"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a+"}},
     "structured_outputs", "both"),
])
def test_refused_with_vllms_words_where_it_has_them(body, param, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        ResponsesRequest(model="m", **body)
    assert info.value.param == param


def test_neutral_router_extensions_ask_for_nothing():
    assert ResponsesRequest(model="m", input="x", include_stop_str_in_output=False).input == "x"


def test_an_empty_input_list_without_history_is_refused():
    with pytest.raises(InvalidRequestError, match="input must not be empty"):
        chat(input=[])
