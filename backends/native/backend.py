"""The native engine behind the ``Backend`` protocol: tokenises, templates, streams chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from backends.base import (
    Backend,
    BackendInfo,
    EngineStats,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    UnavailableError,
)
from backends.native.async_engine import AsyncEngine
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine


class NativeBackend(Backend):
    """Our own engine, in-process. ``start`` loads the model (seconds) in a worker thread."""

    def __init__(self, model_name: str, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        self.name = f"native:{model_name}"
        self.model_name = model_name
        self.config = config or EngineConfig()
        self._engine = engine
        self._owns_engine = engine is None  # an engine passed in is shared, and closed by its owner
        self._async: AsyncEngine | None = None

    async def start(self) -> None:
        if self._engine is None:
            self._engine = await asyncio.to_thread(LLMEngine, self.config)
        self._async = AsyncEngine(self._engine)

    async def close(self) -> None:
        if self._async is not None:
            await asyncio.to_thread(self._async.close)
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
    def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The engine's own stream of chunks: closing it (the client left) aborts the request."""
        if self._async is None:
            raise UnavailableError(f"backend {self.name} is not started")
        return self._async.generate(request.request_id, self._prompt_ids(request), request.params)

    async def health(self) -> bool:
        return self._async is not None and self._async.alive

    async def info(self) -> BackendInfo:
        engine = self.engine
        return BackendInfo(model_ids=[self.model_name], max_model_len=engine.max_model_len,
                           tokenizer=str(engine.model_path))

    async def tokenize(self, text: str | None = None, messages: list[dict[str, Any]] | None = None,
                       add_special_tokens: bool = True) -> list[int]:
        return self._encode(text, messages, add_special_tokens)

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
        return self._encode(request.prompt, request.messages, request.add_special_tokens)

    def _encode(self, text: str | None, messages: list[dict[str, Any]] | None, add_special_tokens: bool) -> list[int]:
        tokenizer = self.engine.tokenizer
        if messages is not None:
            return tokenizer.apply_chat_template(messages)
        try:
            return tokenizer.encode(text or "", add_special_tokens=add_special_tokens)
        except (UnicodeError, TypeError, ValueError) as exc:  # e.g. lone surrogates
            raise InvalidRequestError(f"prompt cannot be tokenised: {exc}", param="prompt") from exc
