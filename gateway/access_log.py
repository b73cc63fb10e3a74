"""Request ids and the access log: one line per request, carrying the id that follows it everywhere.

A request's ``X-Request-Id`` is the client's when it sent a usable one, else a new one (32 random hex digits, as
vLLM's ``--enable-request-id-headers`` makes them). It is returned on the response, forwarded upstream by
the HTTP backends (``backends.base.REQUEST_ID``), attached to every log record written while the request
is served, and written in the access line. ``configure_logging`` writes text or JSON lines (one object per
record, python-json-logger) for log pipelines.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Literal

from pythonjsonlogger.json import JsonFormatter

from backends.base import REQUEST_ID, random_id

HEADER = b"x-request-id"
_USABLE = re.compile(rb"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces: safe in a header and a log line
access_log = logging.getLogger("burstgate.access")

LogFormat = Literal["text", "json"]


class RequestIdMiddleware:
    """Gives each HTTP request its id, returns it as ``X-Request-Id`` and logs the request when it ends."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = header(scope, HEADER) or b""
        request_id = sent.decode() if sent and _USABLE.fullmatch(sent) else random_id()
        token = REQUEST_ID.set(request_id)
        start, status = time.perf_counter(), 499  # no answer begun: the client left first

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # answered 500 outside this middleware (Starlette's ServerErrorMiddleware)
            status = 500 if status == 499 else status
            raise
        finally:
            _log_access(scope, status, time.perf_counter() - start)
            REQUEST_ID.reset(token)


def header(scope, name: bytes) -> bytes | None:
    """The first value of the (lower-case) header ``name`` of an ASGI HTTP scope, or None."""
    return next((value for key, value in scope["headers"] if key == name), None)


def _log_access(scope, status: int, seconds: float) -> None:
    if not access_log.isEnabledFor(logging.INFO):  # the fields below cost more than the check
        return
    client = scope.get("client")
    peer = f"{client[0]}:{client[1]}" if client else "-"
    method, path = scope["method"], scope["path"]
    access_log.info('%s "%s %s HTTP/%s" %d %.1f ms', peer, method, path, scope.get("http_version", "1.1"), status,
                    seconds * 1000, extra={"request_id": REQUEST_ID.get(), "client": peer, "method": method, "path": path, "status": status,
                                           "duration_ms": round(seconds * 1000, 3)})


class RequestIdFilter(logging.Filter):
    """Stamps every record with the id of the request being served (``-`` outside any request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get() or "-"
        return True


def configure_logging(level: str, fmt: LogFormat = "text") -> None:
    """Root logging for ``burstgate serve``: text lines, or one JSON object per line."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(request_id)s %(message)s",
                                           rename_fields={"asctime": "time", "levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
