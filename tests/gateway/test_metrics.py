"""Prometheus metrics: request outcomes, latency histograms, token counters and live engine gauges."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _value(samples, name, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def test_requests_tokens_and_latencies_are_counted(start_gateway):
    with start_gateway() as (url, _):
        before = _scrape(url)
        for _ in range(3):
            httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi there", "max_tokens": 4,
                                                      "ignore_eos": True}, timeout=60)
        httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5000})
        after = _scrape(url)

    def delta(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("burstgate:requests_total", model=MODEL, status="ok") == 3
    assert delta("burstgate:requests_total", model=MODEL, status="invalid_request") == 1
    assert delta("burstgate:generation_tokens_total", model=MODEL) == 12
    assert delta("burstgate:prompt_tokens_total", model=MODEL) == 3 * 2
    assert delta("burstgate:time_to_first_token_seconds_count", model=MODEL) == 3
    assert delta("burstgate:inter_token_latency_seconds_count", model=MODEL) == 9
    assert delta("burstgate:e2e_request_latency_seconds_count", model=MODEL) == 4
    assert _value(after, "burstgate:requests_in_flight", model=MODEL) == 0
    assert _value(after, "burstgate:backend_healthy") == 1
    assert _value(after, "burstgate:prefix_cache_queries_total") > 0


def test_engine_gauges_say_what_the_engine_holds_while_it_serves_and_after(start_gateway, native_engine):
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with start_gateway() as (url, _):
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()  # held: a dropped line iterator closes the response, and the request ends
            next(line for line in lines if line.startswith("data: "))  # it runs
            during = _scrape(url)
        for _ in range(100):  # the client left: the engine drops the sequence at its next step
            after = _scrape(url)
            if _value(after, "burstgate:num_requests_running", model=MODEL) == 0:
                break
    stats = native_engine.stats()
    assert _value(during, "burstgate:num_requests_running", model=MODEL) == 1
    assert _value(during, "burstgate:num_requests_waiting", model=MODEL) == 0
    assert 0 < _value(during, "burstgate:kv_cache_usage_perc", model=MODEL) < 1
    assert _value(after, "burstgate:num_requests_running", model=MODEL) == 0
    assert _value(after, "burstgate:kv_cache_usage_perc", model=MODEL) == 0
    assert _value(after, "burstgate:num_preemptions_total", model=MODEL) == stats.preemptions
    assert _value(after, "burstgate:prefix_cache_hit_rate", model=MODEL) == pytest.approx(
        stats.prefix_cache_hits / stats.prefix_cache_queries)
