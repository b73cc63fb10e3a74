"""What operators and orchestrators call: liveness, readiness, Prometheus metrics, the server's settings and
the deployments' state."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.auth import authenticate, authenticate_admin, authenticate_metrics
from gateway.info import server_info
from gateway.routes import gateway_of
from gateway.service import Caller
from gateway.wire import schemas

router = APIRouter(tags=["operations"])


@router.get("/health", responses=schemas.ok(schemas.Health))
async def health():
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/ready", responses={**schemas.ok(schemas.Readiness, 404), 503: {"model": schemas.Readiness}})
async def ready(request: Request, model: str | None = None):
    """Readiness: this gateway can serve at least one model (a healthy deployment, or a fallback
    with one), so one model's outage never pulls the pod out of its Service. ``?model=NAME`` asks
    about that model alone: 503 when it cannot be served, 404 when it is not configured. 503 from
    the moment the process is told to stop (``draining``: gateway/drain.py)."""
    gateway = gateway_of(request)
    groups = [gateway.group(model)] if model is not None else list(gateway.groups.values())
    state = {g.name: gateway.can_serve(g) for g in groups}
    ok = any(state.values()) and not gateway.drain.draining
    return JSONResponse({"ready": ok, "models": state, "draining": gateway.drain.draining},
                        status_code=200 if ok else 503)


@router.get("/metrics", responses={**schemas.COMMON, 200: {
    "description": "Prometheus' text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request, _: None = Depends(authenticate_metrics)):
    return Response(generate_latest(gateway_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/info", responses=schemas.ok(schemas.ServerInfo))
async def info(request: Request, _: Caller = Depends(authenticate)):
    """The server's devices and, per model, each deployment's kind and engine settings (no secrets)."""
    return server_info(gateway_of(request))


@router.get("/admin/backends", responses=schemas.ok(schemas.Backends))
async def admin_backends(request: Request, _: None = Depends(authenticate_admin)):
    """Each model's deployments: health, breaker, load and latency as this gateway sees them."""
    return {"models": [{"name": g.name, "routing": g.routing, "fallbacks": g.fallbacks, "deployments": [
        {"name": d.name, "backend": d.backend.name, "healthy": d.healthy, "weight": d.weight,
         "breaker": d.breaker.state.name.lower(), "consecutive_failures": d.breaker.consecutive_failures,
         "in_flight": d.limiter.in_flight, "waiting": d.limiter.waiting,
         "ttft_ewma_ms": None if d.ttft_ewma_s is None else round(d.ttft_ewma_s * 1000, 3)}
        for d in g.deployments]} for g in gateway_of(request).groups.values()]}
