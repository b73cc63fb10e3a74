"""Drive an adapter once, the way the gateway does, and collect what it yields."""

from __future__ import annotations

import asyncio

from backends.base import Backend, GenerationChunk, GenerationRequest, SamplingParams


def collect(make_adapter, stream: bool = True, *, prompt="say something", messages=None, **params
            ) -> tuple[list[GenerationChunk], str]:
    """(chunks, joined text) of one request through a fresh adapter from ``make_adapter()``, closed after."""
    async def main():
        adapter: Backend = make_adapter()
        request = GenerationRequest("r", "toy", SamplingParams(**params), prompt=None if messages else prompt,
                                    messages=messages, stream=stream)
        try:
            return [c async for c in adapter.stream(request)]
        finally:
            await adapter.close()
    chunks = asyncio.run(main())
    return chunks, "".join(c.text for c in chunks)
