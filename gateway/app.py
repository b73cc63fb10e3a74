"""The FastAPI app: the gateway it serves and its keys in ``app.state``, the middleware, and the routers of
gateway/routes/ (OpenAI's chat and completions, its Responses API, tokenizer, operations)."""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from gateway import errors
from gateway.access_log import RequestIdMiddleware, header
from gateway.auth import ApiKeys
from gateway.errors import BodyTooLarge
from gateway.responses.service import Responses
from gateway.routes import openai, operations, responses, tokenizer
from gateway.service import Gateway
from gateway.tracing import TracingMiddleware


def create_app(gateway: Gateway, manage_lifecycle: bool = True) -> FastAPI:
    """The ASGI app serving ``gateway``; with ``manage_lifecycle`` it starts and closes the backends."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if manage_lifecycle:
            await gateway.start()
            gateway.drain.take_over_sigterm()  # SIGTERM drains first; the server's own handler runs after
        try:
            yield
        finally:
            await app.state.responses.close()
            if manage_lifecycle:
                await gateway.close()

    # the routers' routes are the app's own: included as routers, every request went through FastAPI's
    # included-router layer (docs/performance.md, "The gateway's instructions per request")
    app = FastAPI(title="burstgate", version="0.1.0", lifespan=lifespan,
                  routes=[route for module in (openai, responses, tokenizer, operations) for route in module.router.routes],
                  description="OpenAI-compatible gateway in front of the native engine, vLLM, TGI and DeepSpeed.")
    app.state.gateway = gateway
    app.state.keys = ApiKeys.from_settings(gateway.settings)
    app.state.responses = Responses.from_settings(gateway, gateway.settings)
    errors.install(app)
    app.add_middleware(BodyLimitMiddleware, limit=gateway.settings.limits.max_body_bytes)
    if gateway.tracing is not None:  # only when on: no per-request cost otherwise
        app.add_middleware(TracingMiddleware, tracing=gateway.tracing)
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so even a 413 carries the id
    return app


class BodyLimitMiddleware:
    """Refuses bodies over ``limit`` bytes with 413, by Content-Length or while streaming in."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = header(scope, b"content-length")
        if length is not None:  # the server reads exactly Content-Length bytes: nothing more to count
            if not length.isdigit() or int(length) > self.limit:
                return await errors.error_response(errors.body_too_large(self.limit))(scope, receive, send)
            return await self.app(scope, receive, send)
        seen = 0

        async def limited_receive():  # chunked: count as it streams in
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        return await self.app(scope, limited_receive, send)
