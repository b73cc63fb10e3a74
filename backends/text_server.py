"""The base of adapters for servers with their own text-in/text-out API (TGI, LightLLM, MII), and of
those among them with TGI's ``/generate`` API (TGI, LightLLM)."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncGenerator, Mapping
from pathlib import Path
from typing import Any, ClassVar

from backends.base import (
    Backend,
    BackendError,
    BackendInfo,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    UpstreamError,
    Usage,
    refuse_unsupported,
)
from backends.http import HTTPClient, TextServerConfig, json_body, raise_for_status, sse_events, transport_errors
from backends.openai_http import OpenAIHTTPBackend
from backends.stopping import StopStringFilter
from backends.tokenizer import Tokenizer


class TextServerBackend(Backend):
    """Base of adapters for servers that take a text prompt and return text (TGI, LightLLM, MII).

    It owns what they have in common: chat (the server's OpenAI route, or a local chat template),
    stop strings with vLLM's semantics (servers keep the stop string in their output; we cut it and
    never stream it), and usage on the last chunk. Subclasses speak the wire format in ``_generate``.
    """

    kind = "text-server"
    openai_chat_path: str | None = None  # where the server's OpenAI routes live, if it has them ("/v1")
    health_path = "/health"
    server_name = "text servers"  # in error messages
    # What the server has no equivalent for (``SamplingParams`` fields, "tools", "echo"), refused with a 400.
    unsupported: tuple[str, ...] = ("n", "logit_bias", "prompt_logprobs", "structured", "tools", "echo")

    def __init__(self, model_name: str, cfg: TextServerConfig) -> None:
        self.name = f"{self.kind}:{cfg.url}"
        self.base_url = cfg.url.rstrip("/")
        self.upstream_model = cfg.upstream_model or model_name
        self._http = HTTPClient(self.base_url, cfg, self.name)
        self._chat_server: OpenAIHTTPBackend | None = None
        self._template_path = cfg.tokenizer if cfg.chat == "template" else None
        self._tokenizer: Tokenizer | None = None
        if cfg.chat == "server" and self.openai_chat_path is not None:
            self._chat_server = OpenAIHTTPBackend(model_name, cfg, url=self.base_url + self.openai_chat_path)

    async def close(self) -> None:
        await self._http.close()
        if self._chat_server is not None:
            await self._chat_server.close()

    async def health(self) -> bool:
        return await self._http.ok(self.health_path)

    async def info(self) -> BackendInfo:
        return BackendInfo(model_ids=[self.upstream_model])

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        if request.messages is not None and self._chat_server is not None:
            async with contextlib.aclosing(self._chat_server.stream(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        refuse_unsupported(request, self.unsupported, self.server_name)
        prompt = self._prompt_text(request)
        stops = StopStringFilter(request.params.stop)
        generated = 0
        async with transport_errors(self.name), contextlib.aclosing(self._generate(prompt, request)) as chunks:
            async for chunk in chunks:
                generated += max(len(chunk.token_ids), 1 if chunk.text else 0)
                text, _ = stops.push(chunk.text)
                if chunk.finish_reason is None:
                    if text or chunk.logprobs:
                        yield GenerationChunk(text=text, token_ids=chunk.token_ids, logprobs=chunk.logprobs)
                    continue
                # The server stops on the same stop string (it was sent), so its last event comes next.
                reason = "stop" if stops.stopped else chunk.finish_reason
                usage = chunk.usage or Usage(0, generated)
                yield GenerationChunk(text=text + stops.flush(), token_ids=chunk.token_ids, logprobs=chunk.logprobs,
                                      finish_reason=reason, usage=usage)
                return
        raise UpstreamError(f"{self.name}: the stream ended without a finish reason")

    def _prompt_text(self, request: GenerationRequest) -> str:
        if request.messages is not None:
            if self._template_path is None:
                raise InvalidRequestError(
                    f"{self.name} serves chat only with `chat: template` and a local tokenizer", param="messages")
            if self._tokenizer is None:
                self._tokenizer = Tokenizer(Path(self._template_path))
            return self._tokenizer.render_chat(request.messages)
        if not isinstance(request.prompt, str):
            raise InvalidRequestError(f"{self.name} takes text prompts, not token ids", param="prompt")
        return request.prompt

    @abc.abstractmethod
    def _generate(self, prompt: str, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Raw chunks from the server: text deltas (stop strings not yet cut), then one chunk with
        ``finish_reason`` and, when the server reports them, token counts in ``usage``."""


class GenerateAPIBackend(TextServerBackend):
    """Servers with TGI's ``POST /generate`` and ``/generate_stream`` (``{"inputs", "parameters"}`` in, SSE
    token events out): TGI and LightLLM. Subclasses map parameters, replies and events."""

    errors: ClassVar[dict[int, type[BackendError]]] = {}  # HTTP status -> our error
    error_field = "error"  # where the error body keeps its message

    async def _generate(self, prompt: str, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        body = {"inputs": prompt, "parameters": self.parameters(request.params)}
        if not request.stream:
            reply = await self._http.call("POST", "/generate", json=body)
            raise_for_status(reply.status, reply.content, self.errors, self.error_field)
            yield self.reply_chunk(json_body(reply.content), reply.headers, request.params)
            return
        async with self._http.stream("POST", "/generate_stream", json=body) as r:
            if r.status != 200:
                raise_for_status(r.status, await r.read(), self.errors, self.error_field)
            async for event in sse_events(r):
                chunk = self.event_chunk(event, request.params)
                if chunk is None:
                    continue
                yield chunk
                if chunk.finish_reason is not None:
                    return

    @abc.abstractmethod
    def parameters(self, params: SamplingParams) -> dict[str, Any]:
        """The ``parameters`` object of a request (``unsupported`` fields are refused before)."""

    @abc.abstractmethod
    def reply_chunk(self, reply: Any, headers: Mapping[str, str], params: SamplingParams) -> GenerationChunk:
        """The one chunk of a ``/generate`` answer."""

    @abc.abstractmethod
    def event_chunk(self, event: Any, params: SamplingParams) -> GenerationChunk | None:
        """The chunk of one ``/generate_stream`` event (None: skip it)."""

