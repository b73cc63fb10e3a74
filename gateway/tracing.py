"""OpenTelemetry traces of each request, exported over OTLP (``--otlp-traces-endpoint``, vLLM's flag).

Off unless an endpoint is configured, and then nothing of OpenTelemetry is even imported: the gateway's request
path checks one ``None``. On, every request is one trace:

- ``POST /v1/...`` (server span, from ``TracingMiddleware``): the whole exchange, a stream's last byte included;
  it continues the client's W3C ``traceparent`` when one is sent;
- ``admit``: the caller's rate limits (the key's name);
- ``route``: the routing decision, per attempt: policy, deployment chosen and the policy's reason;
- ``upstream``: one attempt on one deployment (client span): a ``first_token`` event, tokens counted, the outcome;
  HTTP backends receive its context as ``traceparent``, so vLLM's own spans join the trace.

Spans go through a batch processor: exporting never holds a request up, and a collector that is down loses spans,
never requests.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from backends.base import REQUEST_ID

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from gateway.deployments import Deployment
    from gateway.routing import Choice

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"  # OpenTelemetry's variable: http/protobuf (default) or grpc


class TracingConfig(BaseModel):
    """``tracing:`` in the config file."""

    model_config = ConfigDict(extra="forbid")

    # an OTLP/HTTP collector's traces URL (http://collector:4318/v1/traces), or its gRPC address with
    # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc; None: no tracing
    otlp_traces_endpoint: str | None = None
    service_name: str = "burstgate"  # the spans' service.name
    sample_ratio: float = Field(1.0, ge=0, le=1)  # of traces started here; a client's sampled flag is followed


class Tracing:
    """The tracer provider, its exporter and the spans the gateway opens (see the module's docstring)."""

    def __init__(self, config: TracingConfig) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self.provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}),
                                       sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        self.provider.add_span_processor(BatchSpanProcessor(_exporter(config.otlp_traces_endpoint)))
        self.tracer = self.provider.get_tracer("burstgate")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_config(cls, config: TracingConfig) -> Tracing | None:
        """The tracing ``config`` asks for; None (no tracing, nothing of OpenTelemetry loaded) without an endpoint."""
        return cls(config) if config.otlp_traces_endpoint else None

    def close(self) -> None:
        """Export what is still buffered, then stop."""
        self.provider.shutdown()

    # ------------------------------------------------------------------------------------------ spans
    def start(self, name: str, attributes: dict[str, Any] | None = None, client: bool = False) -> Span:
        """A span under the current one (the request's, set by the middleware), not made current: the gateway's
        generators cross tasks, so each span is passed where it is needed and ended explicitly."""
        kind = self._trace.SpanKind.CLIENT if client else self._trace.SpanKind.INTERNAL
        return self.tracer.start_span(name, kind=kind, attributes=attributes)

    def route(self, model: str, policy: str, choice: Choice, attempt: int) -> None:
        """The routing decision of one attempt, as a span of its own."""
        self.start("route", {"burstgate.model": model, "burstgate.routing.policy": policy,
                             "burstgate.routing.deployment": choice.deployment.name,
                             "burstgate.routing.reason": choice.reason, "burstgate.attempt": attempt}).end()

    def upstream(self, model: str, deployment: Deployment) -> Span:
        """One attempt on one deployment; ``traceparent`` gives its context to the backend."""
        return self.start("upstream", {"burstgate.model": model, "burstgate.deployment": deployment.name,
                                       "burstgate.backend": deployment.backend.name}, client=True)

    def traceparent(self, span: Span) -> str | None:
        """The W3C ``traceparent`` header naming ``span`` as the parent of what the backend does."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier.get("traceparent")

    def failed(self, span: Span, kind: str, message: str) -> None:
        """Mark ``span`` as failed with the error's kind (``burstgate.error``) and message."""
        span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, message))
        span.set_attribute("burstgate.error", kind)


def _exporter(endpoint: str | None):
    protocol = os.environ.get(PROTOCOL_ENV, "http/protobuf")
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError(f"{PROTOCOL_ENV}=grpc needs opentelemetry-exporter-otlp-proto-grpc installed") from None
        return OTLPSpanExporter(endpoint=endpoint)
    if protocol != "http/protobuf":
        raise ValueError(f"{PROTOCOL_ENV} must be http/protobuf or grpc, not {protocol!r}")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


class TracingMiddleware:
    """One server span per HTTP request, current for all the request's work (the streamed body included), continuing
    the client's ``traceparent``; inside ``RequestIdMiddleware``, so it carries the request's id. Installed only
    when tracing is on."""

    def __init__(self, app, tracing: Tracing) -> None:
        self.app, self.tracing = app, tracing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from opentelemetry import context, trace

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k in (b"traceparent", b"tracestate")}
        parent = self.tracing.propagator.extract(headers)
        span = self.tracing.tracer.start_span(f"{scope['method']} {scope['path']}", context=parent,
                                              kind=trace.SpanKind.SERVER,
                                              attributes={"http.request.method": scope["method"],
                                                          "url.path": scope["path"],
                                                          "burstgate.request_id": REQUEST_ID.get() or ""})
        token = context.attach(trace.set_span_in_context(span, parent))
        status = 500

        async def traced_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        finally:
            if status >= 500:
                span.set_status(trace.Status(trace.StatusCode.ERROR))
            span.end()
            context.detach(token)
