"""Prometheus metrics: request outcomes, latency histograms, token counters and live engine gauges."""

from __future__ import annotations

import httpx
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
    for gauge in ("burstgate:num_requests_running", "burstgate:num_requests_waiting", "burstgate:kv_cache_usage_perc",
                  "burstgate:prefix_cache_hit_rate", "burstgate:num_preemptions_total"):
        assert any(n == gauge for n, _ in after), gauge
    assert _value(after, "burstgate:prefix_cache_queries_total") > 0
