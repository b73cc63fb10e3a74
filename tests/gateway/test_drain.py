"""SIGTERM drains a ``burstgate serve`` process (gateway/drain.py): ``/ready`` turns 503 at once, new requests are
served through the grace window and refused after it, requests in flight run to their end, and those still
running at the drain deadline end with a clean error (in-band for a stream), never a cut connection.

The replicas are simulated (``--simulate``: the native engine's scheduler, each step paced as the 2-core CPU
profile models it), so a stream lasts seconds without computing a model.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from gateway.config import DEFAULT_MODEL_NAME as MODEL
from tests.servers import burstgate_serve

SIMULATED = ("--simulate", "cpu-epyc-2c")


def drain_env(grace_s: float, timeout_s: float) -> dict[str, str]:
    return {"BURSTGATE_SERVER__DRAIN_GRACE_S": str(grace_s), "BURSTGATE_SERVER__DRAIN_TIMEOUT_S": str(timeout_s)}


def stream(url: str, max_tokens: int, started: threading.Event | None = None) -> list[dict | str]:
    """A streamed completion's events (parsed JSON, or "[DONE]"); ``started`` is set at its first token."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    events: list[dict | str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                if started is not None:
                    started.set()
    return events


def completed(events: list[dict | str], max_tokens: int) -> bool:
    """The stream ran to its end: every token, its finish reason, then [DONE]."""
    chunks = [e for e in events if isinstance(e, dict)]
    return (events[-1] == "[DONE]" and "error" not in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "length"
            and sum(1 for c in chunks if c["choices"][0]["text"]) >= max_tokens - 1)


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def in_flight(url: str) -> float:
    """Requests the gateway is serving now (its gauge, every deployment)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
               if line.startswith("burstgate:requests_in_flight{"))


def refused(url: str) -> bool:
    """Whether the server no longer takes a connection: refused, or, when the connect raced the listener's close,
    accepted into the backlog and closed without an answer."""
    try:
        httpx.get(f"{url}/health", timeout=2)
    except (httpx.ConnectError, httpx.RemoteProtocolError):
        return True
    return False


def test_sigterm_fails_readiness_at_once_serves_the_grace_window_then_refuses_and_finishes_every_stream():
    with burstgate_serve(*SIMULATED, env=drain_env(grace_s=5, timeout_s=120)) as served:
        url = served.url
        started = [threading.Event() for _ in range(3)]
        with ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream, url, 200, s) for s in started]  # ~9 s each: past the grace window
            assert all(s.wait(60) for s in started)
            served.proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: httpx.get(f"{url}/ready", timeout=10).json()["draining"])  # the signal's turn
            assert httpx.get(f"{url}/ready", timeout=10).status_code == 503
            late = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                              timeout=60)  # inside the grace window: still served
            assert late.status_code == 200 and late.json()["usage"]["completion_tokens"] == 2
            deadline = time.monotonic() + 30
            while not refused(url):  # after it: the listener is closed
                assert time.monotonic() < deadline, "still accepting connections after the grace window"
                time.sleep(0.2)
            assert all(completed(s.result(), 200) for s in streams)  # the streams in flight were not cut
        assert served.proc.wait(timeout=60) in (0, -signal.SIGTERM)


def test_requests_still_running_at_the_drain_deadline_end_with_a_clean_error_not_a_cut_connection():
    with burstgate_serve(*SIMULATED, env=drain_env(grace_s=0, timeout_s=2)) as served:
        url = served.url
        started = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            streamed = pool.submit(stream, url, 2000, started)  # ~90 s at the simulated pace: past the deadline
            folded = pool.submit(httpx.post, f"{url}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 2000, "ignore_eos": True})
            assert started.wait(60)
            assert wait_until(lambda: in_flight(url) == 2)  # the folded one too, before the signal
            served.proc.send_signal(signal.SIGTERM)
            events, answer = streamed.result(), folded.result()
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "server_shutting_down", events[-2]
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "server_shutting_down"
        assert served.proc.wait(timeout=60) in (0, -signal.SIGTERM)


def test_a_second_sigterm_skips_the_rest_of_the_grace_window():
    with burstgate_serve(*SIMULATED, env=drain_env(grace_s=600, timeout_s=900)) as served:
        served.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert httpx.get(f"{served.url}/ready", timeout=10).status_code == 503
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=60) in (0, -signal.SIGTERM)  # not 600 s later
