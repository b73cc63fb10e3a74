"""OpenTelemetry traces (gateway/tracing.py), exported over OTLP/HTTP to a real receiver started by the test
(tests/otlp.py): one trace per request with its admission, routing decision and upstream call, the client's
``traceparent`` continued and the gateway's sent on to the HTTP backend."""

from __future__ import annotations

import httpx
import pytest
from starlette.responses import PlainTextResponse

from gateway.app import create_app
from gateway.config import ApiKey, ModelRoute, OpenAIDeployment, Resilience, Settings
from gateway.service import Gateway
from gateway.tracing import TracingConfig
from loadtest.mock_server import create_mock_app
from tests.otlp import Receiver
from tests.servers import serve_app

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class HeaderRecorder:
    """The mock OpenAI server, remembering the ``traceparent`` of each request it is sent."""

    def __init__(self) -> None:
        self.app, self.traceparents = create_mock_app("upstream", itl_s=0.01), []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            self.traceparents.append(dict(scope["headers"]).get(b"traceparent", b"").decode())
        await self.app(scope, receive, send)


@pytest.fixture
def receiver():
    receiver = Receiver()
    with serve_app(receiver.app()) as url:
        receiver.url = f"{url}/v1/traces"
        yield receiver


@pytest.fixture(scope="module")
def upstream():
    recorder = HeaderRecorder()
    with serve_app(recorder) as url:
        recorder.url = f"{url}/v1"
        yield recorder


def traced_gateway(receiver: Receiver, url: str, **settings) -> Gateway:
    deployment = OpenAIDeployment(kind="openai", url=url, upstream_model="upstream")
    return Gateway.from_settings(Settings(models=[ModelRoute(name="m", deployments=[deployment])],
                                          tracing=TracingConfig(otlp_traces_endpoint=receiver.url), **settings))


def test_a_streamed_request_is_one_trace_continuing_the_clients_and_handed_on_to_the_backend(receiver, upstream):
    body = {"model": "m", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    with serve_app(create_app(traced_gateway(receiver, upstream.url))) as url:  # leaving it flushes the spans
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                          headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}) as response:
            assert response.status_code == 200 and response.read().endswith(b"data: [DONE]\n\n")
    (server,) = receiver.named("POST /v1/chat/completions")
    (admit,), (route,), (call,) = receiver.named("admit"), receiver.named("route"), receiver.named("upstream")
    assert {s.trace_id for s in receiver.spans} == {CLIENT_TRACE} and {s.service for s in receiver.spans} == {"burstgate"}
    assert server.parent_span_id == CLIENT_SPAN and server.kind == "SERVER"
    assert server.attributes["http.response.status_code"] == 200 and server.attributes["burstgate.request_id"]
    assert admit.parent_span_id == route.parent_span_id == call.parent_span_id == server.span_id
    assert route.attributes["burstgate.routing.deployment"] == "m/openai-0"
    assert route.attributes["burstgate.routing.reason"] and route.attributes["burstgate.routing.policy"]
    assert call.kind == "CLIENT" and call.events == ["first_token"] and not call.error
    assert call.attributes["gen_ai.usage.output_tokens"] == 8 and call.attributes["burstgate.status"] == "ok"
    assert upstream.traceparents[-1] == f"00-{CLIENT_TRACE}-{call.span_id}-01"  # the backend's spans join in
    assert server.end_ns >= call.end_ns  # the server span covers the stream to its last byte


class FailingUpstream(HeaderRecorder):
    """Healthy to health checks, failing every generation with a 500."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            return await PlainTextResponse("boom", status_code=500)(scope, receive, send)
        await self.app(scope, receive, send)


def test_a_failed_attempt_and_its_retry_are_traced_as_errors(receiver):
    resilience = Resilience(retries=1, retry_backoff_s=0, health_interval_s=60)
    with serve_app(FailingUpstream()) as failing, \
            serve_app(create_app(traced_gateway(receiver, f"{failing}/v1", resilience=resilience))) as url:
        reply = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2})
        assert reply.status_code == 502
    (server,) = receiver.named("POST /v1/completions")
    calls = receiver.named("upstream")
    assert [c.attributes["burstgate.attempt"] for c in receiver.named("route")] == [1, 2]
    assert len(calls) == 2 and all(c.error and c.attributes["burstgate.error"] == "upstream_error" for c in calls)
    assert server.error and server.attributes["http.response.status_code"] == 502


def test_a_request_over_its_keys_limit_is_traced_as_refused_at_admission(receiver, upstream):
    keys = [ApiKey(name="team-a", key="k-1", requests_per_minute=1)]
    with serve_app(create_app(traced_gateway(receiver, upstream.url, api_keys=keys))) as url:
        answers = [httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer k-1"},
                              json={"model": "m", "prompt": "Hi", "max_tokens": 2}).status_code for _ in range(2)]
    assert answers == [200, 429]
    admits = receiver.named("admit")
    assert [a.error for a in admits] == [False, True] and {a.attributes["burstgate.key"] for a in admits} == {"team-a"}
    assert len(receiver.named("upstream")) == 1  # the refused request never reached a backend
