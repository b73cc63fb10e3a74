"""Sends one request to an OpenAI-compatible target and records what the client saw, chunk by chunk.

HTTP goes through aiohttp: streaming a request costs the client about 0.2 ms of CPU here against 3 ms
with httpx, and every millisecond the client spends is send lag, or CPU taken from a local server.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from loadtest.metrics import RequestRecord
from loadtest.workload import RequestSpec


@dataclass
class Target:
    """A base URL (the server root, without /v1) and a model name, optionally with an API key."""

    url: str
    model: str
    api_key: str | None = None
    label: str = ""

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/").removesuffix("/v1")
        self.label = self.label or f"{self.model}@{self.url}"

    @classmethod
    def parse(cls, spec: str, api_key: str | None = None) -> Target:
        """``URL#MODEL`` as given to ``--target``."""
        url, sep, model = spec.rpartition("#")
        if not sep or not url or not model:
            raise ValueError(f"target {spec!r} must look like URL#MODEL")
        return cls(url, model, api_key)


@dataclass
class RequestOptions:
    endpoint: str = "completions"  # or "chat"
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 600.0  # whole request
    stall_timeout_s: float = 120.0  # longest silence between bytes
    extra_body: dict = field(default_factory=dict)


def new_client(options: RequestOptions) -> aiohttp.ClientSession:
    """One session per event loop: unlimited connections, kept alive between requests."""
    timeout = aiohttp.ClientTimeout(total=options.timeout_s, sock_connect=30.0, sock_read=options.stall_timeout_s)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


async def send(client: aiohttp.ClientSession, target: Target, spec: RequestSpec, record: RequestRecord,
               options: RequestOptions, clock=time.perf_counter) -> RequestRecord:
    """Stream one request into ``record`` (never raises: failures are recorded with their kind)."""
    chat = options.endpoint == "chat"
    body = {"model": target.model, "max_tokens": spec.max_tokens, "stream": True, "temperature": options.temperature,
            "stream_options": {"include_usage": True}, **options.extra_body}
    if options.ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    record.prompt_tokens = spec.prompt_tokens
    record.actual_send = clock()
    chunks = 0
    finished = False
    try:
        async with client.post(target.url + path, json=body, headers=headers) as r:
            record.status = r.status
            if r.status != 200:
                text = (await r.read()).decode("utf-8", "replace")
                return _fail(record, f"http_{r.status}", text[:500])
            async for line in r.content:  # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = clock()
                event = json.loads(data)
                if "error" in event:
                    return _fail(record, "error_event", str(event["error"])[:500])
                choices = event.get("choices") or []
                if choices:
                    if record.first_response is None:
                        record.first_response = now
                    c = choices[0]
                    text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    if text:
                        record.chunk_times.append(now)
                        chunks += 1
                    finished = finished or c.get("finish_reason") is not None
                usage = event.get("usage")
                if usage:
                    record.output_tokens = usage.get("completion_tokens", 0)
                    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
        return _fail(record, "timeout", f"{type(exc).__name__} after {clock() - record.actual_send:.1f}s")
    except aiohttp.ClientError as exc:
        return _fail(record, "connection", repr(exc)[:500])
    except ValueError as exc:
        return _fail(record, "malformed", f"unparseable SSE event: {exc}"[:500])
    if not finished:
        return _fail(record, "incomplete", "the stream ended without a finish_reason")
    if record.output_tokens == 0:
        record.output_tokens = chunks  # no usage from the server: one token per chunk
    record.ok = True
    return record


def _fail(record: RequestRecord, kind: str, message: str) -> RequestRecord:
    record.ok, record.error_kind, record.error = False, kind, message
    return record
