"""Chunks as a Response object and as the Responses API's events, in OpenAI's order, numbered in sequence."""

from __future__ import annotations

import json

from backends.base import GenerationChunk, TokenLogprob, ToolCallDelta, Usage
from gateway.responses.encoding import ResponseAssembler, sse
from gateway.responses.requests import ResponsesRequest


def assemble(chunks, **body):
    a = ResponseAssembler(ResponsesRequest(**{"model": "m", "input": "x", **body}))
    events = a.opening()
    for chunk in chunks:
        events += a.feed(chunk)
    return a, events + a.closing()


TEXT = [GenerationChunk(text="Hel"), GenerationChunk(text="lo"),
        GenerationChunk(finish_reason="stop", usage=Usage(5, 2, 3))]


def test_text_streams_in_openais_order_and_the_last_event_is_the_whole_response():
    a, events = assemble(TEXT)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    done = events[-1]["response"]
    message = done["output"][0]
    assert done["status"] == "completed" and message["status"] == "completed"
    assert message["content"][0]["text"] == "Hello" and events[6]["text"] == "Hello"
    assert {e["item_id"] for e in events[3:8]} == {events[8]["item"]["id"]} == {message["id"]}
    assert done["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 2,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 7}
    assert done == a.response()


def test_tool_calls_close_the_message_before_them_and_each_other():
    chunks = [GenerationChunk(text="Checking."),
              GenerationChunk(tool_calls=[ToolCallDelta(0, "call_a", "get_weather")]),
              GenerationChunk(tool_calls=[ToolCallDelta(0, arguments='{"city": '),
                                          ToolCallDelta(0, arguments='"Paris"}')]),
              GenerationChunk(tool_calls=[ToolCallDelta(1, "call_b", "get_time", '{}')]),
              GenerationChunk(finish_reason="tool_calls", usage=Usage(9, 20))]
    a, events = assemble(chunks)
    kinds = [e["type"] for e in events][2:]
    assert kinds == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    output = events[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call", "function_call"]
    assert output[1] | {"id": None} == {"id": None, "type": "function_call", "status": "completed",
                                        "arguments": '{"city": "Paris"}', "call_id": "call_a", "name": "get_weather"}
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert a.output_messages() == [{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]


def test_cut_by_max_output_tokens_is_incomplete_and_still_ends_with_completed_as_vllm_writes_it():
    _, events = assemble([GenerationChunk(text="Once upon"), GenerationChunk(finish_reason="length")],
                         max_output_tokens=2)
    done = events[-1]
    assert done["type"] == "response.completed"
    assert done["response"]["status"] == "incomplete"
    assert done["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert done["response"]["output"][0]["status"] == "completed"  # vLLM's (OpenAI marks it incomplete)


def test_nothing_generated_is_one_empty_message():
    a, events = assemble([GenerationChunk(finish_reason="stop", usage=Usage(4, 0))])
    assert [item["content"][0]["text"] for item in a.items] == [""]
    assert events[-1]["response"]["output"][0]["type"] == "message"


def test_logprobs_only_when_included():
    lp = [TokenLogprob(1, "Hi", -0.5, [(1, "Hi", -0.5), (2, "Yo", -1.5)])]
    chunks = [GenerationChunk(text="Hi", logprobs=lp), GenerationChunk(finish_reason="stop")]
    _, plain = assemble(chunks)
    assert plain[4]["logprobs"] == []
    _, included = assemble(chunks, include=["message.output_text.logprobs"], top_logprobs=1)
    delta = included[4]["logprobs"][0]
    assert (delta["token"], delta["logprob"], [t["token"] for t in delta["top_logprobs"]]) == ("Hi", -0.5, ["Hi"])
    assert included[-1]["response"]["output"][0]["content"][0]["logprobs"] == included[4]["logprobs"]


def test_failed_after_the_start_is_a_failed_response():
    a = ResponseAssembler(ResponsesRequest(model="m", input="x"))
    a.opening()
    a.feed(GenerationChunk(text="Hi"))
    (event,) = a.failed({"code": "upstream_error", "message": "engine died"})
    assert event["type"] == "response.failed" and event["response"]["status"] == "failed"
    assert event["response"]["error"] == {"code": "upstream_error", "message": "engine died"}


def test_events_are_sent_with_their_type_line():
    raw = sse({"type": "response.created", "sequence_number": 0})
    head, data = raw.decode().strip().split("\n")
    assert head == "event: response.created" and json.loads(data.removeprefix("data: "))["sequence_number"] == 0
