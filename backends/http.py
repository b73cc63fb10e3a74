"""What every HTTP adapter shares: the client, transport errors as ours, SSE parsing, and the base of
adapters for servers with their own text-in/text-out API (TGI, LightLLM, MII).
"""

from __future__ import annotations

import abc
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from backends.base import (
    Backend,
    BackendError,
    BackendInfo,
    BackendTimeoutError,
    GenerationChunk,
    GenerationRequest,
    InvalidRequestError,
    UnavailableError,
    UpstreamError,
    Usage,
)
from backends.stop_strings import StopStringFilter


@dataclass
class Reply:
    """A whole HTTP answer."""

    status: int
    content: bytes
    headers: Mapping[str, str]

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class HTTPClient:
    """One pooled connection set to one upstream, on aiohttp (measured here: about 0.5 ms less per
    request than httpx, most of a gateway's own latency). First-token and total deadlines are the
    gateway's; here only the connect limit and the longest silence between two bytes."""

    def __init__(self, base_url: str, cfg: Any, name: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name
        self._headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout_s,
                                              sock_read=cfg.read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else self.base_url + path

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:  # created in the loop that serves requests
            self._session = aiohttp.ClientSession(
                headers=self._headers, timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60))
        return self._session

    async def call(self, method: str, path: str, json: Any = None, timeout_s: float | None = None) -> Reply:
        """The whole answer; transport failures raised as our errors."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        async with transport_errors(self.name), self._client().request(
                method, self._url(path), json=json, timeout=timeout) as r:
            return Reply(r.status, await r.read(), r.headers)

    @contextlib.asynccontextmanager
    async def stream(self, method: str, path: str, json: Any = None) -> AsyncIterator[aiohttp.ClientResponse]:
        """The response with its body unread (``lines`` reads it); wrap the reading in ``transport_errors``."""
        async with transport_errors(self.name), self._client().request(method, self._url(path), json=json) as r:
            yield r

    async def ok(self, path: str, timeout_s: float = 5.0) -> bool:
        """Whether ``GET path`` answers 200 (health checks)."""
        try:
            return (await self.call("GET", path, timeout_s=timeout_s)).status == 200
        except BackendError:
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


@contextlib.asynccontextmanager
async def transport_errors(name: str):
    """aiohttp's timeouts and connection failures as our ``BackendTimeoutError`` / ``UnavailableError``."""
    try:
        yield
    except TimeoutError as exc:  # aiohttp's connect and read timeouts are TimeoutErrors
        raise BackendTimeoutError(f"{name} timed out: {type(exc).__name__}") from exc
    except aiohttp.ClientError as exc:  # refused, reset, closed mid-body
        raise UnavailableError(f"{name} unreachable: {exc!r}") from exc


async def lines(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The body's lines as they arrive, whatever their length."""
    pending = b""
    async for chunk in response.content.iter_any():
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
    if pending:
        yield pending.decode("utf-8", "replace")


DONE = "[DONE]"


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """The JSON payloads of a Server-Sent Events body (``data:`` with or without a space, as axum and
    Starlette write it); comments and keep-alives are skipped; ``[DONE]`` is yielded as ``DONE``."""
    async for line in lines(response):
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == DONE:
            yield DONE
            continue
        try:
            yield json.loads(data)
        except ValueError as exc:
            raise UpstreamError(f"malformed SSE event from upstream: {data[:200]!r}") from exc


def json_body(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError as exc:
        raise UpstreamError(f"malformed reply from upstream: {content[:200]!r}") from exc


class TextServerBackend(Backend):
    """Base of adapters for servers that take a text prompt and return text (TGI, LightLLM, MII).

    It owns what they have in common: chat (the server's OpenAI route, or a local chat template),
    stop strings with vLLM's semantics (servers keep the stop string in their output; we cut it and
    never stream it), and usage on the last chunk. Subclasses speak the wire format in ``_generate``.
    """

    kind = "text-server"
    openai_chat_path: str | None = None  # where the server's OpenAI routes live, if it has them ("/v1")
    health_path = "/health"

    def __init__(self, model_name: str, cfg: Any) -> None:
        self.name = f"{self.kind}:{cfg.url}"
        self.base_url = cfg.url.rstrip("/")
        self.upstream_model = cfg.upstream_model or model_name
        self._http = HTTPClient(self.base_url, cfg, self.name)
        self._chat_server = None
        self._template_path = cfg.tokenizer if cfg.chat == "template" else None
        self._tokenizer = None
        if cfg.chat == "server" and self.openai_chat_path is not None:
            from backends.openai_http import OpenAIHTTPBackend

            self._chat_server = OpenAIHTTPBackend(model_name, cfg.model_copy(update={
                "url": self.base_url + self.openai_chat_path}))

    async def close(self) -> None:
        await self._http.close()
        if self._chat_server is not None:
            await self._chat_server.close()

    async def health(self) -> bool:
        return await self._http.ok(self.health_path)

    async def info(self) -> BackendInfo:
        return BackendInfo(model_ids=[self.upstream_model])

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if request.messages is not None and self._chat_server is not None:
            async with contextlib.aclosing(self._chat_server.stream(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        prompt = self._prompt_text(request)
        stops = StopStringFilter(request.params.stop)
        generated = 0
        async with transport_errors(self.name), contextlib.aclosing(self._generate(prompt, request)) as chunks:
            async for chunk in chunks:
                generated += max(len(chunk.token_ids), 1 if chunk.text else 0)
                text, hit = stops.push(chunk.text)
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
                from backends.tokenizer import Tokenizer

                self._tokenizer = Tokenizer(Path(self._template_path))
            return self._tokenizer.render_chat(request.messages)
        if not isinstance(request.prompt, str):
            raise InvalidRequestError(f"{self.name} takes text prompts, not token ids", param="prompt")
        return request.prompt

    @abc.abstractmethod
    def _generate(self, prompt: str, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Raw chunks from the server: text deltas (stop strings not yet cut), then one chunk with
        ``finish_reason`` and, when the server reports them, token counts in ``usage``."""


def raise_for_status(status: int, content: bytes, mapping: dict[int, type[BackendError]],
                     message_field: str | None = None) -> None:
    """Unless ``status`` is 200, raise the error ``mapping`` names for it (default ``UpstreamError``),
    with the message from the JSON body's ``message_field`` when there is one, else the body's text."""
    if status == 200:
        return
    message = content[:500].decode("utf-8", "replace")
    if message_field is not None:
        try:
            message = json.loads(content).get(message_field, message)
        except (ValueError, AttributeError):
            pass
    error = mapping.get(status, UpstreamError)
    raise error(message if error is InvalidRequestError else f"upstream answered {status}: {message}")
