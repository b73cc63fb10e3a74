"""The gateway keeps answering when backends fail: retries, fallbacks, breakers, deadlines.

Backends are real processes (``burstgate loadtest mock-server``) killed with SIGKILL, or small
Starlette servers that misbehave on purpose.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.app import create_app
from gateway.config import ModelRoute, OpenAIDeployment, Resilience, Settings
from gateway.service import Gateway
from tests.servers import free_port, free_ports, serve_app, spawn_mock_server, wait_for_port

FAST_RECOVERY = Resilience(retries=3, retry_backoff_s=0.01, breaker_failures=3, breaker_cooldown_s=0.5,
                       health_interval_s=0.2, health_timeout_s=1.0)


def remote(name: str, url: str, **kw) -> OpenAIDeployment:
    return OpenAIDeployment(kind="openai", name=name, url=url, upstream_model="mock", **kw)


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def deployments(url: str) -> dict[str, dict]:
    return {d["name"]: d for m in httpx.get(f"{url}/admin/backends").json()["models"] for d in m["deployments"]}


def wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def completion(url: str, model: str = "m", **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4, **body},
                      timeout=30)


def test_a_backend_killed_during_a_burst_loses_no_request_and_returns_after_restart():
    port_a, port_b = free_ports(2)
    a = spawn_mock_server(port_a, ttft_ms=150)
    b = spawn_mock_server(port_b, ttft_ms=150)
    try:
        settings = Settings(models=[ModelRoute(name="m", deployments=[
            remote("a", f"http://127.0.0.1:{port_a}/v1", max_concurrency=16),
            remote("b", f"http://127.0.0.1:{port_b}/v1", max_concurrency=16)])], router=FAST_RECOVERY)
        with serve_app(create_app(Gateway.from_settings(settings))) as url:

            async def burst() -> list[int]:
                async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
                    tasks = [asyncio.create_task(client.post(f"{url}/v1/completions", json={
                        "model": "m", "prompt": f"request {i}", "max_tokens": 4})) for i in range(200)]
                    while sum(t.done() for t in tasks) < 40:
                        await asyncio.sleep(0.01)
                    b.kill()  # SIGKILL mid-burst: in-flight requests on b lose their connection
                    return [(await t).status_code for t in tasks]

            statuses = asyncio.run(burst())
            assert statuses == [200] * 200  # zero requests lost
            assert metric(url, "burstgate:retries_total", backend="b") > 0
            assert metric(url, "burstgate:requests_total", backend="b", status="unavailable") > 0
            state = deployments(url)["b"]
            assert state["breaker"] == "open" and not state["healthy"]
            served_by_b = metric(url, "burstgate:requests_total", backend="b", status="ok")

            # Traffic keeps flowing to a alone.
            assert all(completion(url).status_code == 200 for _ in range(5))
            assert metric(url, "burstgate:requests_total", backend="b", status="ok") == served_by_b

            # b comes back on the same port: health check, half-open probe, breaker closed, traffic back.
            b = spawn_mock_server(port_b, ttft_ms=0)
            wait_until(lambda: deployments(url)["b"]["healthy"])
            for _ in range(20):
                assert completion(url).status_code == 200
            assert deployments(url)["b"]["breaker"] == "closed"
            assert metric(url, "burstgate:requests_total", backend="b", status="ok") > served_by_b
            assert metric(url, "burstgate:breaker_state", backend="b") == 0
    finally:
        a.kill()
        b.kill()


def test_a_stream_whose_backend_dies_ends_with_an_error_event_and_done():
    port = free_port()
    proc = spawn_mock_server(port, itl_ms=100)
    try:
        settings = Settings(models=[ModelRoute(name="m", deployments=[remote("only", f"http://127.0.0.1:{port}/v1")])],
                            router=FAST_RECOVERY)
        with serve_app(create_app(Gateway.from_settings(settings))) as url:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
                    "model": "m", "prompt": "hi", "max_tokens": 100, "stream": True}) as r:
                assert r.status_code == 200
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            proc.kill()
            assert all(json.loads(e)["choices"][0]["text"] == " tok" for e in events[:3])
            error = json.loads(events[-2])["error"]
            assert error["type"] == "service_unavailable" or "unreachable" in error["message"]
            assert events[-1] == "[DONE]"
    finally:
        proc.kill()


def _counting_upstream(fail_first: int, status: int):
    """An OpenAI-compatible server whose first ``fail_first`` completions answer ``status``."""
    calls = []

    async def completions(request):
        calls.append(await request.json())
        if len(calls) <= fail_first:
            return JSONResponse({"error": {"message": f"failure {len(calls)}", "type": "x", "param": None,
                                           "code": None}}, status_code=status)
        return JSONResponse({"id": "c", "object": "text_completion", "created": 0, "model": "mock", "choices": [
            {"index": 0, "text": "fine", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def models(_):
        return JSONResponse({"object": "list", "data": [{"id": "mock"}]})

    return calls, Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                                    Route("/v1/models", models)])


def test_server_errors_before_the_first_byte_are_retried_and_client_errors_are_not():
    for status, fail_first, expected_status, expected_calls in [(503, 2, 200, 3), (500, 2, 200, 3),
                                                                (429, 1, 200, 2), (400, 1, 400, 1)]:
        calls, upstream = _counting_upstream(fail_first, status)
        with serve_app(upstream) as up:
            settings = Settings(models=[ModelRoute(name="m", deployments=[remote("flaky", f"{up}/v1")])],
                                router=FAST_RECOVERY)
            with serve_app(create_app(Gateway.from_settings(settings))) as url:
                r = completion(url)
                assert (r.status_code, len(calls)) == (expected_status, expected_calls), status
                if expected_status == 200:
                    assert r.json()["choices"][0]["text"] == "fine"
                    assert metric(url, "burstgate:retries_total", backend="flaky") == fail_first


def test_a_dead_model_falls_back_to_the_next_model_in_its_list():
    with serve_app(_counting_upstream(0, 200)[1]) as backup:
        dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
        settings = Settings(models=[
            ModelRoute(name="primary", deployments=[remote("dead", dead)], fallbacks=["backup"]),
            ModelRoute(name="lonely", deployments=[remote("dead-too", dead)]),
            ModelRoute(name="backup", deployments=[remote("backup", f"{backup}/v1")])], router=FAST_RECOVERY)
        with serve_app(create_app(Gateway.from_settings(settings))) as url:
            r = completion(url, model="primary")
            assert r.status_code == 200 and r.json()["model"] == "primary"
            assert metric(url, "burstgate:fallbacks_total", model="primary", fallback="backup") == 1
            r = completion(url, model="lonely")
            assert r.status_code == 503 and r.json()["error"]["message"] == "no healthy backend for model 'lonely'"


def test_first_token_deadline_answers_504_after_retries():
    port = free_port()
    proc = spawn_mock_server(port, ttft_ms=5000)
    try:
        wait_for_port(port)
        settings = Settings(models=[ModelRoute(name="m", deployments=[
            remote("slow", f"http://127.0.0.1:{port}/v1", first_token_timeout_s=0.3)])],
            resilience=Resilience(retries=1, retry_backoff_s=0.01, breaker_failures=10))
        with serve_app(create_app(Gateway.from_settings(settings))) as url:
            started = time.monotonic()
            r = completion(url, stream=True)
            assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
            assert time.monotonic() - started < 4  # two attempts of 0.3 s, not the 5 s upstream delay
            assert metric(url, "burstgate:retries_total", backend="slow", kind="timeout") == 1
    finally:
        proc.kill()
