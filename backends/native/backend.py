"""The native engine behind the ``Backend`` protocol: tokenises, templates, streams chunks."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, cast

from backends.base import (
    Backend,
    BackendInfo,
    EngineStats,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    TokenLogprob,
    UnavailableError,
    refuse_extra_fields,
)
from backends.native.async_engine import AsyncEngine
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine, start_engine
from backends.native.sampler import token_logprob
from backends.tool_calls import call_format, check_tool_request, parse_tool_calls, tool_call_grammar


class NativeBackend(Backend):
    """Our own engine, in-process. ``start`` loads the model (seconds) in a worker thread."""

    def __init__(self, model_name: str, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        self.name = f"native:{model_name}"
        self.model_name = model_name
        self.config = config or (engine.config if engine is not None else EngineConfig())
        self._engine = engine
        self._owns_engine = engine is None  # an engine passed in is shared, and closed by its owner
        self._async: AsyncEngine | None = None
        template = self.config.chat_template
        self.chat_template = Path(template).read_text() if template and Path(template).is_file() else template

    async def start(self) -> None:
        if self._engine is None:
            self._engine = await asyncio.to_thread(start_engine, self.config)
        self._async = AsyncEngine.attach(self._engine)

    async def close(self) -> None:
        if self._async is not None:
            await asyncio.to_thread(self._async.detach)
            self._async = None
        if self._owns_engine and self._engine is not None:
            await asyncio.to_thread(self._engine.close)
            self._engine = None

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None or self._async is None:
            raise UnavailableError(f"backend {self.name} is not started")
        return self._engine

    # ----------------------------------------------------------------------------------- protocol
    def stream(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """The engine's own stream of chunks: closing it (the client left) aborts the request. With tools,
        a forced ``tool_choice`` becomes the grammar of the call and the text is parsed into tool calls."""
        if self._async is None:
            raise UnavailableError(f"backend {self.name} is not started")
        refuse_extra_fields(request, self.name)
        params, fmt = request.params, None
        if request.calls_tools:
            check_tool_request(self.config.tool_parser, request.tools, request.tool_choice, params.structured)
            fmt = call_format(self.config.tool_parser, request.tool_choice)
            assert fmt is not None and request.tools  # check_tool_request refused tool calls in no format
            grammar = tool_call_grammar(fmt, request.tools, request.tool_choice, request.parallel_tool_calls)
            # Tool-call markers may be special tokens: the parser must see them (vLLM's hermes parser too).
            params = dataclasses.replace(params, structured=grammar or params.structured, skip_special_tokens=False)
        prompt_ids = self._prompt_ids(request)
        chunks = self._async.generate(request.request_id, prompt_ids, params)
        if fmt is not None:  # the answer may call tools
            chunks = parse_tool_calls(chunks, fmt, request.tool_choice)
        if request.echo:
            text = request.prompt if isinstance(request.prompt, str) else self.engine.tokenizer.decode(prompt_ids)
            chunks = self._echo(chunks, text, prompt_ids[0])
        return chunks

    async def _echo(self, chunks: AsyncIterator[GenerationChunk], prompt_text: str, first_token: int
                    ) -> AsyncGenerator[GenerationChunk, None]:
        """Each choice's first chunk with the prompt before it: its text, and with logprobs the prompt's
        (vLLM's echo: the prompt logprobs, the first token's None)."""
        echoed: set[int] = set()
        async for chunk in chunks:
            if chunk.index not in echoed:
                echoed.add(chunk.index)
                logprobs = chunk.logprobs
                if logprobs is not None:
                    first = token_logprob(self.engine.tokenizer, first_token, None)
                    prompt = (chunk.prompt_logprobs or [])[1:]  # only the first prompt token has no logprob
                    logprobs = [first, *cast("list[TokenLogprob]", prompt), *logprobs]
                chunk = dataclasses.replace(chunk, text=prompt_text + chunk.text, logprobs=logprobs)
            yield chunk

    async def health(self) -> bool:
        return self._async is not None and self._async.alive

    async def info(self) -> BackendInfo:
        engine = self.engine
        return BackendInfo(model_ids=[self.model_name], max_model_len=engine.max_model_len,
                           tokenizer=str(engine.model_path))

    async def tokenize(self, text: str | None = None, messages: list[dict[str, Any]] | None = None,
                       add_special_tokens: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self._encode(text, messages, add_special_tokens, tools)

    async def detokenize(self, token_ids: list[int]) -> str:
        engine = self.engine
        bad = next((t for t in token_ids if not 0 <= t < engine.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"Token id {bad} is out of vocabulary (vocab size {engine.vocab_size}).",
                                      param="tokens")
        return engine.tokenizer.decode(token_ids, skip_special_tokens=False)

    def stats(self) -> EngineStats | None:
        return self._engine.stats() if self._engine is not None else None

    # ------------------------------------------------------------------------------------ helpers
    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if isinstance(request.prompt, list):
            return list(request.prompt)
        return self._encode(request.prompt, request.messages, request.add_special_tokens, request.tools)

    def _encode(self, text: str | None, messages: list[dict[str, Any]] | None, add_special_tokens: bool,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
        tokenizer = self.engine.tokenizer
        if messages is not None:
            return tokenizer.apply_chat_template(messages, tools, self.chat_template)
        try:
            return tokenizer.encode(text or "", add_special_tokens=add_special_tokens)
        except (UnicodeError, TypeError, ValueError) as exc:  # e.g. lone surrogates
            raise InvalidRequestError(f"prompt cannot be tokenised: {exc}", param="prompt") from exc
