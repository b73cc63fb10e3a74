"""What every HTTP adapter shares: its configuration, the client, transport errors as ours, SSE parsing
and status mapping."""

from __future__ import annotations

import contextlib
import json
import os
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, FilePath, model_validator

from backends.base import (
    REQUEST_ID,
    TRACEPARENT,
    BackendError,
    BackendTimeoutError,
    InvalidRequestError,
    UnavailableError,
    UpstreamError,
)

ENV_REFERENCE = "os.environ/"  # LiteLLM's form for a secret read from the environment


def from_environment(name: str, what: str) -> str:
    """The value of the environment variable ``name``, which a config names for ``what``."""
    if name not in os.environ:
        raise ValueError(f"the environment variable {name} named for {what} is not set")
    return os.environ[name]


def env_reference(value: str) -> str | None:
    """The variable named by ``value`` if it is an ``os.environ/NAME`` reference, else None."""
    return value.removeprefix(ENV_REFERENCE) if value.startswith(ENV_REFERENCE) else None


class RemoteConfig(BaseModel):
    """How to reach a model server over HTTP."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # errors never echo a key

    url: str  # the server's base URL (http:// or https://), without /v1
    upstream_model: str | None = None  # the name the server knows the model by; default: the public name
    # or "os.environ/NAME": read from the environment when the config loads; never in a repr
    api_key: str | None = Field(None, repr=False)
    api_key_env: str | None = None  # the name of an environment variable holding the key
    connect_timeout_s: float = Field(5.0, gt=0)  # for opening a connection to the server
    read_timeout_s: float = Field(300.0, gt=0)  # longest silence between two bytes from upstream
    # an https:// upstream: the CA bundle its certificate is checked against (default: the system's), and this
    # gateway's own certificate and key for servers that ask for one (mutual TLS); PEM files
    ca_bundle: FilePath | None = None  # the CAs the upstream's certificate is checked against
    client_cert: FilePath | None = None  # this gateway's certificate (and key, unless client_key)
    client_key: FilePath | None = None  # when the key is not in client_cert's file
    # the name the server's certificate must carry, where the URL names an address instead (a discovered replica:
    # its pod's IP, its certificate the Service's name); default: the URL's host
    tls_server_name: str | None = None

    @model_validator(mode="after")
    def _key_from_environment(self) -> RemoteConfig:
        """Keys mounted from a secret into the environment, never written in the config file."""
        if self.api_key_env and self.api_key:
            raise ValueError("give api_key or api_key_env, not both")
        name = self.api_key_env or (env_reference(self.api_key) if self.api_key else None)
        if name is not None:
            self.api_key, self.api_key_env = from_environment(name, "the api key"), None
        return self

    @model_validator(mode="after")
    def _tls_files_load(self) -> RemoteConfig:
        if self.client_key and not self.client_cert:
            raise ValueError("client_key needs client_cert")
        self.ssl_context()  # a certificate or key that does not load is a config error, not a first-request one
        return self

    def tls_verify(self) -> ssl.SSLContext | bool:
        """What a client checks the server with: these TLS settings, else True (the defaults)."""
        return self.ssl_context() or True

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS settings for this upstream: None for the defaults (the system's CAs, no client certificate)."""
        if not (self.ca_bundle or self.client_cert):
            return None
        try:
            context = ssl.create_default_context(cafile=self.ca_bundle)
            if self.client_cert:
                context.load_cert_chain(self.client_cert, self.client_key)
        except ssl.SSLError as exc:
            raise ValueError(f"the TLS files do not load: {exc}") from None
        return context


class TextServerConfig(RemoteConfig):
    """A server with its own text-in/text-out API (TGI, LightLLM, MII)."""

    chat: Literal["server", "template"] = "server"  # chat through the server's OpenAI route, or a local template
    tokenizer: str | None = None  # local HF directory or .gguf whose chat template renders messages

    @model_validator(mode="after")
    def _template_needs_tokenizer(self) -> TextServerConfig:
        if self.chat == "template" and not self.tokenizer:
            raise ValueError("chat: template needs a tokenizer (a local HF directory or .gguf)")
        return self


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
    """One pooled connection set to one upstream, on aiohttp (cheaper per request than httpx, which was most
    of a gateway's own latency). First-token and total deadlines are the
    gateway's; here only the connect limit and the longest silence between two bytes."""

    def __init__(self, base_url: str, cfg: RemoteConfig, name: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name
        self._headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout_s,
                                              sock_read=cfg.read_timeout_s)
        self._ssl = cfg.tls_verify()
        self._server_hostname = cfg.tls_server_name  # None: the URL's host
        self._session: aiohttp.ClientSession | None = None

    def _url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else self.base_url + path

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:  # created in the loop that serves requests
            self._session = aiohttp.ClientSession(
                headers=self._headers, timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60, ssl=self._ssl))
        return self._session

    async def call(self, method: str, path: str, json: Any = None, timeout_s: float | None = None) -> Reply:
        """The whole answer; transport failures raised as our errors."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        async with transport_errors(self.name), self._client().request(
                method, self._url(path), json=json, timeout=timeout, headers=_request_id_header(),
                server_hostname=self._server_hostname) as r:
            return Reply(r.status, await r.read(), r.headers)

    @contextlib.asynccontextmanager
    async def stream(self, method: str, path: str, json: Any = None) -> AsyncIterator[aiohttp.ClientResponse]:
        """The response with its body unread (``lines`` reads it); wrap the reading in ``transport_errors``."""
        async with transport_errors(self.name), self._client().request(
                method, self._url(path), json=json, headers=_request_id_header(),
                server_hostname=self._server_hostname) as r:
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


def _request_id_header() -> dict[str, str] | None:
    """The served request's id for the upstream (vLLM takes it as its own request id), and the trace it is part
    of when tracing is on."""
    request_id, traceparent = REQUEST_ID.get(), TRACEPARENT.get()
    if traceparent is None:
        return {"X-Request-Id": request_id} if request_id else None
    return {"X-Request-Id": request_id, "traceparent": traceparent} if request_id else {"traceparent": traceparent}


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


def raise_for_status(status: int, content: bytes, mapping: dict[int, type[BackendError]],
                     message_field: str | None = None) -> None:
    """Unless ``status`` is 200, raise the error ``mapping`` names for it (default ``UpstreamError``),
    with the message from the JSON body's ``message_field`` when there is one, else the body's text."""
    if status == 200:
        return
    message = content[:500].decode("utf-8", "replace")
    if message_field is not None:
        with contextlib.suppress(ValueError, AttributeError):  # not JSON, or not an object: the text as it is
            message = json.loads(content).get(message_field, message)
    error = mapping.get(status, UpstreamError)
    raise error(message if error is InvalidRequestError else f"upstream answered {status}: {message}")
