"""The one place where failures become HTTP status codes and OpenAI error bodies.

Body shape: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI; vLLM since #22099).
Validation errors are 400, not FastAPI's 422, as vLLM and OpenAI answer.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from backends.base import (
    BackendError,
    BackendTimeoutError,
    InvalidRequestError,
    OverloadedError,
    UnavailableError,
    UpstreamError,
)

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """An error raised by the gateway itself, with its HTTP status decided where it is raised."""

    def __init__(self, status: int, message: str, *, type: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


class ClientDisconnected(Exception):
    """The client hung up before its answer began; the work was cancelled (answered 499, for logs only)."""


class BodyTooLarge(StarletteHTTPException):
    """A body found over the limit while it streams in (chunked). An ``HTTPException`` because FastAPI
    re-raises those from body parsing, where any other exception becomes a 400."""

    def __init__(self, limit: int) -> None:
        super().__init__(413)
        self.limit = limit


def unauthorized(message: str = "Invalid or missing API key.") -> GatewayError:
    return GatewayError(401, message, type="authentication_error", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})


def model_not_found(model: str) -> GatewayError:
    return GatewayError(404, f"The model `{model}` does not exist.", type="not_found_error", param="model",
                        code="model_not_found")


def rate_limited(message: str, retry_after: float) -> GatewayError:
    return GatewayError(429, message, type="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(max(1, round(retry_after)))})


def body_too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"Request body exceeds the limit of {limit} bytes.", type="invalid_request_error",
                        code="request_too_large")


# Backend error class -> (HTTP status, OpenAI error type)
_BACKEND_STATUS: list[tuple[type[BackendError], int, str]] = [
    (InvalidRequestError, 400, "invalid_request_error"),
    (OverloadedError, 429, "rate_limit_error"),
    (UnavailableError, 503, "service_unavailable"),
    (BackendTimeoutError, 504, "timeout"),
    (UpstreamError, 502, "upstream_error"),
]


def from_backend_error(exc: BackendError) -> GatewayError:
    for cls, status, type_ in _BACKEND_STATUS:
        if isinstance(exc, cls):
            headers = None
            if isinstance(exc, OverloadedError):
                headers = {"Retry-After": str(max(1, round(exc.retry_after)))}
            return GatewayError(status, exc.message, type=type_, param=exc.param, code=exc.code, headers=headers)
    return GatewayError(502, exc.message, type="upstream_error", param=exc.param, code=exc.code)


def error_body(err: GatewayError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_response(err: GatewayError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


def sse_error_event(exc: BaseException) -> bytes:
    """An error after a stream began: sent as a data event (then ``[DONE]``), as vLLM does."""
    err = as_gateway_error(exc)
    return b"data: " + json.dumps(error_body(err)).encode() + b"\n\n"


def as_gateway_error(exc: BaseException) -> GatewayError:
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, BackendError):
        return from_backend_error(exc)
    log.exception("unexpected error", exc_info=exc)
    return GatewayError(500, "Internal server error.", type="server_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for e in exc.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            parts.append(f"Invalid JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
            continue
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc) or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "; ".join(parts) or "Invalid request.", param


def _document_400_not_422(app: FastAPI) -> None:
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for path in schema["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema or {}  # build() keeps its schema there

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to change the schema


def install(app: FastAPI) -> None:
    """Register the handlers that turn every failure into the OpenAI error shape, and take FastAPI's
    422 out of the OpenAPI document (validation errors are 400 here)."""
    _document_400_not_422(app)

    @app.exception_handler(GatewayError)
    async def _gateway(_: Request, exc: GatewayError):
        return error_response(exc)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected):
        return Response(status_code=499)  # nobody is listening: nginx's "client closed request", for logs

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_: Request, exc: BodyTooLarge):
        return error_response(body_too_large(exc.limit))

    @app.exception_handler(BackendError)
    async def _backend(_: Request, exc: BackendError):
        return error_response(from_backend_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(GatewayError(400, message, type="invalid_request_error", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        types = {404: "not_found_error", 405: "invalid_request_error"}
        return error_response(GatewayError(exc.status_code, str(exc.detail), type=types.get(exc.status_code, "error"),
                                           headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        return error_response(as_gateway_error(exc))
