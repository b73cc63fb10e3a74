"""GenerationChunks -> a Response object and the Responses API's typed server-sent events.

One ``ResponseAssembler`` reads a request's chunks in order and keeps the output items they make: a ``message``
item for text (one ``output_text`` part), a ``function_call`` item per tool call. Streamed, each step is an event
in OpenAI's order (``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then the next item, ``response.completed``), each
with its ``sequence_number``; folded, the same items make the object. An answer cut by ``max_output_tokens`` is
``incomplete`` (its items ``completed``) and still ends with ``response.completed``, as vLLM's server writes it
(tests/peers/test_vllm_responses.py).
"""

from __future__ import annotations

import json
import time
from typing import Any

from backends.base import GenerationChunk, Usage, UsageTally, random_id
from gateway.responses.requests import ResponsesRequest
from gateway.wire.encoding import chat_logprobs


def response_id() -> str:
    return f"resp_{random_id()}"


def usage_object(usage: Usage | None) -> dict[str, Any] | None:
    """The Responses API's usage: input and output tokens, cached input tokens, no reasoning tokens."""
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def response_object(request: ResponsesRequest, rid: str, created_at: int, status: str,
                    output: list[dict[str, Any]], usage: Usage | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Response object of ``request`` in ``status`` with ``output`` (OpenAI's keys, in its order)."""
    return {
        "id": rid, "object": "response", "created_at": created_at, "status": status,
        "background": request.background, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": None, "model": request.model, "output": output,
        "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": request.previous_response_id,
        "prompt_cache_key": request.prompt_cache_key, "reasoning": {"effort": None, "summary": None},
        "safety_identifier": request.safety_identifier, "service_tier": "default", "store": request.store,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "text": request.text.as_dict() if request.text else {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": request.effective_tool_choice,
        "tools": [t.model_dump() for t in request.tools],
        "top_logprobs": request.top_logprobs or 0, "top_p": 1.0 if request.top_p is None else request.top_p,
        "truncation": request.truncation, "usage": usage_object(usage), "user": request.user,
        "metadata": request.metadata or {},
    }


class ResponseAssembler:
    """The output of one response from its chunks, and the events that stream it."""

    def __init__(self, request: ResponsesRequest, rid: str | None = None) -> None:
        self.request = request
        self.id = rid or response_id()
        self.created_at = int(time.time())
        self.items: list[dict[str, Any]] = []  # output items, done or open (the last)
        self._open: dict[str, Any] | None = None  # the item being written
        self._logprobs: list[dict[str, Any]] = []  # of the open message's text
        self._sequence = 0
        self.tally = UsageTally()
        self.finish_reason: str | None = None

    # ------------------------------------------------------------------------------------- whole
    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def response(self, status: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Response object as it stands (``status``: as the items say, unless given)."""
        usage = None if status in ("queued", "in_progress") else (self.tally.usage or self.tally.total())
        return response_object(self.request, self.id, self.created_at, status or self.status, _copy(self.items),
                               usage, error)

    def output_messages(self) -> list[dict[str, Any]]:
        """The answer as chat messages, for the conversation's next turn: one assistant message with the text
        and the calls."""
        text = "".join(part["text"] for item in self.items if item["type"] == "message" for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.items if item["type"] == "function_call"]
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return [message]

    # ------------------------------------------------------------------------------------ events
    def opening(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        snapshot = self.response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        """The events of one chunk (the text's delta, the calls' pieces); a folded response drops them."""
        self.tally.add(chunk)
        events: list[dict[str, Any]] = []
        if chunk.text:
            if self._open is None or self._open["type"] != "message":
                events += self._close() + self._open_message()
            item = self._open
            assert item is not None  # opened just above when none was
            logprobs = self._chunk_logprobs(chunk)
            item["content"][0]["text"] += chunk.text
            self._logprobs += logprobs
            events.append(self._event("response.output_text.delta", item_id=item["id"],
                                      output_index=len(self.items) - 1, content_index=0, delta=chunk.text,
                                      logprobs=logprobs))
        for piece in chunk.tool_calls or []:
            if piece.id is not None:  # a new call
                events += self._close()
                item = {"id": f"fc_{random_id()}", "type": "function_call", "status": "in_progress",
                        "arguments": "", "call_id": piece.id, "name": piece.name}
                self._add(item)
                events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                          item=dict(item)))
            if piece.arguments and self._open is not None and self._open["type"] == "function_call":
                self._open["arguments"] += piece.arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                                          output_index=len(self.items) - 1, delta=piece.arguments))
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        return events

    def closing(self) -> list[dict[str, Any]]:
        """The open item's end, then ``response.completed`` with the whole response."""
        events = self._close()
        if not self.items:  # nothing generated: an empty message, as OpenAI answers then
            events += self._open_message() + self._close()
        return [*events, self._event("response.completed", response=self.response())]

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """``response.failed`` for a stream that broke after it began."""
        return [self._event("response.failed", response=self.response("failed", error))]

    def finish(self) -> dict[str, Any]:
        """The whole response once every chunk was folded (the open item closed)."""
        self.closing()
        return self.response()

    # -------------------------------------------------------------------------------------- items
    def _add(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self._open = item

    def _open_message(self) -> list[dict[str, Any]]:
        item: dict[str, Any] = {"id": f"msg_{random_id()}", "type": "message", "status": "in_progress",
                                "content": [], "role": "assistant"}
        self._add(item)
        index = len(self.items) - 1
        part: dict[str, Any] = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        events = [self._event("response.output_item.added", output_index=index, item=_copy(item)),
                  self._event("response.content_part.added", item_id=item["id"], output_index=index,
                              content_index=0, part=dict(part))]
        item["content"].append(part)
        self._logprobs = []
        return events

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed"  # also in an incomplete response, as vLLM writes it (OpenAI: "incomplete")
        if item["type"] == "function_call":
            return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"], name=item["name"]),
                    self._event("response.output_item.done", output_index=index, item=_copy(item))]
        part = item["content"][0]
        part["logprobs"] = self._logprobs
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=self._logprobs),
                self._event("response.content_part.done", item_id=item["id"], output_index=index,
                            content_index=0, part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _chunk_logprobs(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        if not self.request.logprobs or chunk.logprobs is None:
            return []
        return (chat_logprobs(chunk.logprobs, self.request.top_logprobs or 0) or {})["content"]

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, **fields, "sequence_number": self._sequence}
        self._sequence += 1
        return event


def sse(event: dict[str, Any]) -> bytes:
    """One event as the Responses API streams it: its type on the ``event:`` line, the object as data."""
    return b"event: " + event["type"].encode() + b"\ndata: " + json.dumps(event, separators=(",", ":")).encode() \
        + b"\n\n"


def _copy(value: Any) -> Any:
    """A snapshot of items that keep growing (an event holds the state it was made in)."""
    return json.loads(json.dumps(value))

