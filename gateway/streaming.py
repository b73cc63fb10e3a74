"""What the OpenAI routes do with a backend's stream: fold it into one answer, or send it as server-sent
events; merge the streams of a list of prompts; give up when the client leaves."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from backends.base import GenerationChunk, Usage, UsageTally
from gateway.errors import ClientDisconnected, sse_error_event
from gateway.wire.encoding import DONE, ResponseWriter

T = TypeVar("T")


async def fold(stream: AsyncGenerator, writer: ResponseWriter) -> JSONResponse:
    """A non-streaming answer: the whole stream folded into one body per choice."""
    choices: dict[int, GenerationChunk] = {}
    tally = UsageTally()
    async with contextlib.aclosing(stream) as chunks:
        async for chunk in chunks:
            tally.add(chunk)
            choices.setdefault(chunk.index, GenerationChunk(index=chunk.index)).extend(chunk)
    usage = tally.usage or tally.total()
    # plain JSON types already: no jsonable_encoder pass
    return JSONResponse(writer.full([choices[i] for i in sorted(choices)], usage))


async def first(stream: AsyncIterator):
    """The stream's first item, or None when it is empty."""
    return await anext(stream, None)


async def sse(head, stream: AsyncGenerator, writer: ResponseWriter) -> AsyncIterator[bytes]:
    """A streaming answer's server-sent events: ``head``, the first chunk (awaited before the response began, so
    that errors up to it keep their HTTP status), then the rest of ``stream``; later failures are reported
    in-band."""
    async with contextlib.aclosing(stream) as chunks:
        try:
            for event in writer.opening_events(head):
                yield event
            tally = UsageTally()
            async for chunk in _chain([head] if head is not None else [], chunks):
                tally.add(chunk)
                if encoded := writer.chunk_event(chunk):
                    yield encoded
            if writer.include_usage:
                yield writer.usage_event(tally.usage or tally.total())
        except Exception as exc:  # after the first byte the status is sent: report in-band
            yield sse_error_event(exc)
        yield DONE


async def merge(streams: list[AsyncGenerator[GenerationChunk, None]], n: int) -> AsyncGenerator[GenerationChunk, None]:
    """The chunks of several prompts' requests as they come: prompt i's choice j becomes choice i*n + j and
    usage is the sum of the requests' (vLLM's numbering and counting for a list of prompts)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, stream: AsyncGenerator[GenerationChunk, None]) -> None:
        try:
            async for chunk in stream:
                await queue.put((k, chunk))
            await queue.put((k, None))
        except Exception as exc:
            await queue.put((k, exc))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    latest: list[Usage | None] = [None] * len(streams)
    usage = Usage(0, 0, 0)
    try:
        for _ in range(len(streams)):
            while True:
                k, item = await queue.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise item
                if item.usage is not None:  # the sum changes only when a stream's usage does
                    latest[k] = item.usage
                    usage = Usage(*(sum(getattr(u, f) for u in latest if u) for f in
                                    ("prompt_tokens", "completion_tokens", "cached_tokens")))
                yield dataclasses.replace(item, index=k * n + item.index, usage=usage)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def _chain(head: list, rest: AsyncIterator) -> AsyncIterator:
    for item in head:
        yield item
    async for item in rest:
        yield item


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled and ``ClientDisconnected``
    raised (vLLM's ``with_cancellation``). ``work`` runs in this task and a watcher cancels it: one task per
    request instead of two raced by ``asyncio.wait``, which cost instructions on every request."""
    this = asyncio.current_task()
    assert this is not None  # a coroutine of a request runs in its task
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        this.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if gone and this.uncancel() == 0:  # cancelled by the watcher alone, not from outside as well
            raise ClientDisconnected() from None
        raise
    finally:
        watcher.cancel()
