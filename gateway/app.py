"""The FastAPI app: OpenAI routes, vLLM's tokenizer routes, health, readiness and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.base import GenerationChunk, GenerationRequest, InvalidRequestError, Usage, UsageTally, random_id
from gateway import errors
from gateway import response_models as schemas
from gateway.access_log import RequestIdMiddleware, header
from gateway.auth import KeyRing, bearer_token
from gateway.errors import BodyTooLarge, ClientDisconnected, sse_error_event
from gateway.info import server_info
from gateway.limits import KeyLimits
from gateway.openai_format import DONE, ResponseWriter
from gateway.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from gateway.service import ANONYMOUS, Caller, Gateway

T = TypeVar("T")


def create_app(gateway: Gateway, manage_lifecycle: bool = True) -> FastAPI:
    """The ASGI app serving ``gateway``; with ``manage_lifecycle`` it starts and closes the backends."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if manage_lifecycle:
            await gateway.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await gateway.close()

    app = FastAPI(title="burstgate", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible gateway in front of the native engine, vLLM, TGI and DeepSpeed.")
    app.state.gateway = gateway
    errors.install(app)
    app.add_middleware(BodyLimitMiddleware, limit=gateway.settings.limits.max_body_bytes)
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so even a 413 carries the id
    client_keys, admin_keys = KeyRing(gateway.settings.api_keys), KeyRing(gateway.settings.admin_api_keys)
    guarded = bool(client_keys or admin_keys)

    async def authenticate(request: Request) -> Caller:  # async: no threadpool hop per request
        if not client_keys:
            return ANONYMOUS
        key = client_keys.match(bearer_token(request))
        if key is None:
            raise errors.unauthorized()
        return Caller(key.name, KeyLimits(key.requests_per_minute, key.tokens_per_minute))

    async def authenticate_admin(request: Request) -> None:
        """Admin routes take admin keys only; with no key configured at all, nothing is guarded."""
        if guarded and admin_keys.match(bearer_token(request)) is None:
            raise errors.unauthorized("Invalid or missing admin API key." if admin_keys else
                                      "Admin routes are disabled: no admin_api_keys are configured.")

    async def metrics_auth(request: Request) -> None:
        if gateway.settings.protect_metrics and guarded:
            token = bearer_token(request)
            if client_keys.match(token) is None and admin_keys.match(token) is None:
                raise errors.unauthorized()

    # -------------------------------------------------------------------------------- generation
    @app.post("/v1/chat/completions", tags=["openai"], responses=schemas.generation(schemas.ChatCompletion))
    async def chat_completions(body: ChatCompletionRequest, request: Request, caller: Caller = Depends(authenticate)):
        gen = body.generation_request(f"chatcmpl-{random_id()}")
        writer = ResponseWriter(gen.request_id, body.model, True, gen.params.n, body.top_logprobs or 0,
                                body.include_usage, body.continuous_usage)
        return await _serve(request, body, [gen], caller, writer)

    @app.post("/v1/completions", tags=["openai"], responses=schemas.generation(schemas.Completion))
    async def completions(body: CompletionRequest, request: Request, caller: Caller = Depends(authenticate)):
        request_id = f"cmpl-{random_id()}"
        gens = body.generation_requests(request_id)
        writer = ResponseWriter(request_id, body.model, False, len(gens) * gens[0].params.n, 0,
                                body.include_usage, body.continuous_usage)
        return await _serve(request, body, gens, caller, writer)

    async def _serve(request: Request, body: ChatCompletionRequest | CompletionRequest, gens: list[GenerationRequest],
                     caller: Caller, writer: ResponseWriter):
        group = gateway.group(body.model)
        await gateway.admit(caller)
        streams = [gateway.generate(group, gen, caller) for gen in gens]
        stream = streams[0] if len(streams) == 1 else _merge(streams, gens[0].params.n)
        if not body.stream:
            return await _until_disconnect(request, _fold(stream, writer))
        try:  # errors before the first token keep their HTTP status; a client gone by then aborts the work
            first = await _until_disconnect(request, _first(stream))
        except BaseException:
            await stream.aclose()
            raise
        return StreamingResponse(_sse(first, stream, writer), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ---------------------------------------------------------------------------------- models
    @app.get("/v1/models", tags=["openai"], responses=schemas.ok(schemas.ModelList))
    async def list_models(_: Caller = Depends(authenticate)):
        data = []
        for name, group in gateway.groups.items():
            info = await _first_info(group)
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "burstgate",
                         "max_model_len": info.max_model_len if info else None})
        return {"object": "list", "data": data}

    async def _first_info(group):
        for d in group.deployments:
            with contextlib.suppress(Exception):
                return await d.backend.info()
        return None

    # ------------------------------------------------------------------------------- tokenizer
    def _tokenizer_group(model: str | None):
        if model is None:
            if len(gateway.groups) != 1:
                raise InvalidRequestError("model is required when several models are served", param="model")
            return next(iter(gateway.groups.values()))
        return gateway.group(model)

    @app.post("/tokenize", tags=["vllm"], responses=schemas.ok(schemas.TokenizeResponse, 404, 502, 503, 504))
    async def tokenize(body: TokenizeRequest, _: Caller = Depends(authenticate)):
        group = _tokenizer_group(body.model)
        backend = group.choose().backend
        messages = [m.as_template_input() for m in body.messages] if body.messages is not None else None
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        ids = await backend.tokenize(body.prompt, messages, body.add_special_tokens, tools)
        info = await backend.info()
        out = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [await backend.detokenize([i]) for i in ids]
        return out

    @app.post("/detokenize", tags=["vllm"], responses=schemas.ok(schemas.DetokenizeResponse, 404, 502, 503, 504))
    async def detokenize(body: DetokenizeRequest, _: Caller = Depends(authenticate)):
        backend = _tokenizer_group(body.model).choose().backend
        return {"prompt": await backend.detokenize(body.tokens)}

    # ------------------------------------------------------------------------------ operations
    @app.get("/health", tags=["operations"], responses=schemas.ok(schemas.Health))
    async def health():
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/ready", tags=["operations"],
             responses={**schemas.ok(schemas.Readiness, 404), 503: {"model": schemas.Readiness}})
    async def ready(model: str | None = None):
        """Readiness: this gateway can serve at least one model (a healthy deployment, or a fallback
        with one), so one model's outage never pulls the pod out of its Service. ``?model=NAME`` asks
        about that model alone: 503 when it cannot be served, 404 when it is not configured."""
        groups = [gateway.group(model)] if model is not None else list(gateway.groups.values())
        state = {g.name: gateway.can_serve(g) for g in groups}
        ok = any(state.values())
        return JSONResponse({"ready": ok, "models": state}, status_code=200 if ok else 503)

    @app.get("/metrics", tags=["operations"], responses={**schemas.COMMON, 200: {
        "description": "Prometheus' text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics(_: None = Depends(metrics_auth)):
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/info", tags=["operations"], responses=schemas.ok(schemas.ServerInfo))
    async def info_route(_: Caller = Depends(authenticate)):
        """The server's devices and, per model, each deployment's kind and engine settings (no secrets)."""
        return server_info(gateway)

    @app.get("/admin/backends", tags=["operations"], responses=schemas.ok(schemas.Backends))
    async def admin_backends(_: None = Depends(authenticate_admin)):
        return {"models": [{"name": g.name, "routing": g.strategy, "fallbacks": g.fallbacks, "deployments": [
            {"name": d.name, "backend": d.backend.name, "healthy": d.healthy, "weight": d.weight,
             "breaker": d.breaker.state.name.lower(), "consecutive_failures": d.breaker.consecutive_failures,
             "in_flight": d.limiter.in_flight, "waiting": d.limiter.waiting,
             "ttft_ewma_ms": None if d.ttft_ewma_s is None else round(d.ttft_ewma_s * 1000, 3)}
            for d in g.deployments]} for g in gateway.groups.values()]}

    return app


async def _fold(stream: AsyncIterator, writer: ResponseWriter) -> JSONResponse:
    choices: dict[int, GenerationChunk] = {}
    tally = UsageTally()
    async with contextlib.aclosing(stream) as chunks:
        async for chunk in chunks:
            tally.add(chunk)
            choices.setdefault(chunk.index, GenerationChunk(index=chunk.index)).extend(chunk)
    usage = tally.usage or tally.total()
    # plain JSON types already: no jsonable_encoder pass
    return JSONResponse(writer.full([choices[i] for i in sorted(choices)], usage))


async def _first(stream: AsyncIterator):
    """The stream's first item, or None when it is empty."""
    return await anext(stream, None)


async def _sse(first, stream: AsyncIterator, writer: ResponseWriter) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(stream) as chunks:
        try:
            for event in writer.opening_events(first):
                yield event
            tally = UsageTally()
            async for chunk in _chain([first] if first is not None else [], chunks):
                tally.add(chunk)
                event = writer.chunk_event(chunk)
                if event:
                    yield event
            if writer.include_usage:
                yield writer.usage_event(tally.usage or tally.total())
        except Exception as exc:  # after the first byte the status is sent: report in-band
            yield sse_error_event(exc)
        yield DONE


async def _merge(streams: list[AsyncIterator[GenerationChunk]], n: int) -> AsyncIterator[GenerationChunk]:
    """The chunks of several prompts' requests as they come: prompt i's choice j becomes choice i*n + j and
    usage is the sum of the requests' (vLLM's numbering and counting for a list of prompts)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, stream: AsyncIterator[GenerationChunk]) -> None:
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


async def _until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled and ``ClientDisconnected``
    raised (vLLM's ``with_cancellation``). ``work`` runs in this task and a watcher cancels it: one task per
    request instead of two raced by ``asyncio.wait`` (that race cost ~5% of the gateway's instructions per request)."""
    this = asyncio.current_task()
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
