"""A real OTLP/HTTP trace receiver for tests: what an OpenTelemetry collector's ``otlphttp`` receiver takes
(``POST /v1/traces``, an ``ExportTraceServiceRequest`` in protobuf, decoded with OpenTelemetry's own generated
classes), keeping every span it receives."""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


@dataclass
class ReceivedSpan:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    kind: str  # SERVER, CLIENT, INTERNAL, ...
    attributes: dict
    events: list[str]
    error: bool
    start_ns: int
    end_ns: int


@dataclass
class Receiver:
    spans: list[ReceivedSpan] = field(default_factory=list)

    def named(self, name: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.name == name]

    def app(self) -> Starlette:
        async def traces(request: Request) -> Response:
            body = await request.body()
            if request.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            export = ExportTraceServiceRequest.FromString(body)
            for resource_spans in export.resource_spans:
                service = _attributes(resource_spans.resource.attributes).get("service.name", "")
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(_received(span, service) for span in scope_spans.spans)
            return Response(ExportTraceServiceResponse().SerializeToString(), media_type="application/x-protobuf")

        return Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])


def _attributes(values) -> dict:
    out = {}
    for kv in values:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which) if which else None
    return out


def _received(span: Span, service: str) -> ReceivedSpan:
    return ReceivedSpan(name=span.name, service=service, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(), kind=Span.SpanKind.Name(span.kind).removeprefix(
                            "SPAN_KIND_"), attributes=_attributes(span.attributes),
                        events=[e.name for e in span.events], error=span.status.code == Status.STATUS_CODE_ERROR,
                        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano)
