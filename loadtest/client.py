"""Sends one request to an OpenAI-compatible target and records what the client saw, chunk by chunk.

HTTP goes through aiohttp, which costs the client far less CPU per streamed request than httpx, and every
millisecond the client spends is send lag, or CPU taken from a local server.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from loadtest.metrics import RequestRecord
from loadtest.workload import RequestSpec

STALL_SLACK = 0.1  # share of the stall timeout by which its deadline may lag the last read


@dataclass
class Target:
    """A base URL (the server root, without /v1) and a model name, optionally with an API key, the
    server's hardware as declared by the user, and a local tokenizer standing in for the server's."""

    url: str
    model: str
    api_key: str | None = None
    label: str = ""
    hardware: str | None = None  # declared; a burstgate server reports its own on GET /info
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/").removesuffix("/v1")
        self.label = self.label or f"{self.model}@{self.url}"

    @classmethod
    def parse(cls, spec: str, api_key: str | None = None) -> Target:
        """``[LABEL=]URL#MODEL[@HARDWARE]`` as given to ``--target``."""
        label, eq, rest_of_spec = spec.partition("=")
        if not eq or "/" in label or ":" in label:  # no label: an "=" belongs to the URL's query
            label, rest_of_spec = "", spec
        url, sep, rest = rest_of_spec.rpartition("#")
        model, at, hardware = rest.partition("@")
        if not sep or not url or not model or (at and not hardware.strip()) or (eq and not label.strip() and
                                                                                   rest_of_spec != spec):
            raise ValueError(f"target {spec!r} must look like [LABEL=]URL#MODEL[@HARDWARE]")
        return cls(url, model, api_key, label=label.strip(), hardware=hardware.strip() or None)


@dataclass
class RequestOptions:
    endpoint: str = "completions"  # or "chat"
    temperature: float | None = None  # None: the server's default (vLLM's bench sends none either)
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens
    timeout_s: float = 600.0  # whole request, queueing included (vLLM's bench has only this one)
    # longest silence between two lines once the stream has begun; before its first line a request may be
    # queued behind a burst for minutes, and only timeout_s bounds that wait
    stall_timeout_s: float = 120.0
    extra_body: dict = field(default_factory=dict)


def new_client(options: RequestOptions) -> aiohttp.ClientSession:
    """One session per event loop: unlimited connections, kept alive between requests."""
    timeout = aiohttp.ClientTimeout(total=options.timeout_s, sock_connect=30.0)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


async def send(client: aiohttp.ClientSession, target: Target, spec: RequestSpec, record: RequestRecord,
               options: RequestOptions, clock=time.perf_counter) -> RequestRecord:
    """Stream one request into ``record`` (never raises: failures are recorded with their kind)."""
    record.planned_prompt_tokens = record.prompt_tokens = spec.prompt_tokens
    record.max_tokens, record.fixed_output = spec.max_tokens, options.ignore_eos
    record.actual_send = clock()
    try:
        return await _stream(client, target, spec, record, options, clock)
    finally:
        record.end = clock()


async def _stream(client: aiohttp.ClientSession, target: Target, spec: RequestSpec, record: RequestRecord,
                  options: RequestOptions, clock) -> RequestRecord:
    chat = options.endpoint == "chat"
    body = {"model": target.model, "max_tokens": spec.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **options.extra_body}
    if options.temperature is not None:
        body["temperature"] = options.temperature
    if options.ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = spec.messages or [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    events = _Events(record, chat)
    stall = asyncio.timeout(None)  # armed by the stream's first bytes, re-armed by each read after them
    loop = asyncio.get_running_loop()
    try:
        async with client.post(target.url + path, json=body, headers=headers) as r, stall:
            record.status = r.status
            if r.status != 200:
                body_text = (await r.read()).decode("utf-8", "replace")
                return _fail(record, f"http_{r.status}", body_text[:500])
            # Whatever bytes have arrived, split into lines here: one await per read, not per line (a read
            # often holds several events); every event in a read is stamped with the read's time, as vLLM's
            # bench stamps them.
            pending, armed_at, over = b"", -math.inf, False
            rearm_s = options.stall_timeout_s * STALL_SLACK
            async for received in r.content.iter_any():
                # The stall deadline moves only once a tenth of it has passed: moving it on every read cancels and
                # schedules a timer per token, much of the client's event-loop work; a stall is still caught
                # between 90% and 100% of stall_timeout_s after the last read.
                if (at := loop.time()) - armed_at >= rearm_s:
                    stall.reschedule(at + options.stall_timeout_s)
                    armed_at = at
                now = clock()
                *lines, pending = (pending + received).split(b"\n")
                for line in lines:
                    if line and events.line(line, now):  # blank lines end events
                        over = True
                        break
                if over:
                    break
            else:
                events.line(pending, clock())  # a last line without its newline
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        return _fail(record, "timeout", f"{type(exc).__name__} after {clock() - record.actual_send:.1f}s")
    except aiohttp.ClientError as exc:
        return _fail(record, "connection", repr(exc)[:500])
    except ValueError as exc:
        return _fail(record, "malformed", f"unparseable SSE event: {exc}"[:500])
    finally:
        record.generated_text = "".join(events.text)
    if events.error is not None:
        return _fail(record, "error_event", events.error)
    if not record.chunk_times:
        return _fail(record, "no_choices", "the stream carried no event with choices")
    if not events.finished:
        return _fail(record, "incomplete", "the stream ended without a finish_reason")
    record.ok = True
    return record


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None  # completions
    delta: _Delta | None = None  # chat
    finish_reason: str | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Event(msgspec.Struct):
    """The fields of an SSE event the client reads; the rest (ids, logprobs, ...) are skipped unparsed."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None  # an error event: any JSON, kept as text


# Typed: decoding only these fields into slots takes ~0.4 us an event against ~0.9 us for a dict of them all (a
# DecodeError, or a ValidationError for an event of another shape, is a ValueError).
_decode = msgspec.json.Decoder(_Event).decode


class _Events:
    """The SSE lines of one streamed answer, read into its record."""

    def __init__(self, record: RequestRecord, chat: bool) -> None:
        self.record, self.chat = record, chat
        self.text: list[str] = []
        self.finished = False
        self.error: str | None = None

    def line(self, line: bytes, now: float) -> bool:
        """Reads one line received at ``now``; True when the stream is over ([DONE] or an error event)."""
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        event = _decode(data)
        if event.error is not None:
            self.error = str(event.error)[:500]
            return True
        record = self.record
        if choices := event.choices:  # every event with choices times the stream, even with empty text (vLLM)
            record.chunk_times.append(now)
            c = choices[0]
            piece = (c.delta.content if c.delta is not None else None) if self.chat else c.text
            self.text.append(piece or "")
            self.finished = self.finished or c.finish_reason is not None
        elif usage := event.usage:
            record.output_tokens = usage.completion_tokens or 0
            if usage.prompt_tokens is not None:
                record.prompt_tokens = usage.prompt_tokens
            if usage.prompt_tokens_details is not None:
                record.cached_tokens = usage.prompt_tokens_details.cached_tokens
        return False


def _fail(record: RequestRecord, kind: str, message: str) -> RequestRecord:
    record.ok, record.error_kind, record.error = False, kind, message
    return record
