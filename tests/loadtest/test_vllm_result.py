"""The per-target result file in ``vllm bench serve``'s schema: the keys, in the order vLLM 0.32.0 writes them
(vllm/benchmarks/serve.py: ``main_async`` builds date ... max_concurrency, ``benchmark`` the rest), for
``--save-result --save-detailed --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,95,99``."""

from __future__ import annotations

import json

import pytest

from loadtest.metrics import RequestRecord, summarize
from loadtest.vllm_result import file_name, vllm_result

STATS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
         for s in ("mean", "median", "std", "p50", "p90", "p95", "p99")]
VLLM_KEYS = ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
             "queue_times", "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
             *STATS]
QUEUE = [f"{s}_{m}_ms" for m in ("client_queue_time", "e2el_including_client_queue")
         for s in ("mean", "median", "std", "p50", "p90", "p95", "p99")]


def _summary(records, **run) -> dict:
    s = summarize(records, 2.0)
    s.update(label="a@http://h", model_id="org/model", tokenizer_id="tok", num_prompts=len(records),
             request_rate="inf", burstiness=1.0, max_concurrency=None, date="20250101-120000", endpoint="chat",
             backend="openai-chat")
    s.update(run)
    return s


def _records():
    ok = RequestRecord(1, 0.0, actual_send=0.0, chunk_times=[0.5, 0.7, 1.0], prompt_tokens=12, output_tokens=3,
                       ok=True, generated_text="abc", queue_time=0.25)
    failed = RequestRecord(0, 0.0, actual_send=0.0, prompt_tokens=12, ok=False, error_kind="http_500", error="down")
    return [ok, failed]


def test_keys_and_their_order_are_vllms():
    out = vllm_result(_summary(_records()), _records())
    assert list(out) == VLLM_KEYS
    json.dumps(out)  # plain JSON


def test_values_per_request_follow_vllms_conventions():
    out = vllm_result(_summary(_records()), _records())
    assert out["backend"] == out["endpoint_type"] == "openai-chat" and out["request_goodput"] is None
    # lists are in request order; a failed request has 0 output tokens, 0 latencies and its error
    assert out["output_lens"] == [0, 3] and out["input_lens"] == [12, 12] and out["errors"][1] == ""
    assert out["errors"][0] == "http_500: down" and out["ttfts"] == [0.0, 0.5] and out["latencies"] == [0.0, 1.0]
    assert out["itls"][1] == pytest.approx([0.2, 0.3]) and out["completed"] == 1 and out["failed"] == 1


def test_client_queue_statistics_only_with_a_concurrency_limit():
    closed = vllm_result(_summary(_records(), max_concurrency=4), _records())
    assert list(closed) == VLLM_KEYS + QUEUE[:7]  # a burst: no queue-inclusive E2EL (vLLM: rate is inf)
    assert closed["mean_client_queue_time_ms"] == pytest.approx(250)
    paced = vllm_result(_summary(_records(), max_concurrency=4, request_rate=5.0), _records())
    assert list(paced) == VLLM_KEYS + QUEUE and paced["mean_e2el_including_client_queue_ms"] == pytest.approx(1250)


def test_file_names_follow_vllms_pattern_and_never_collide():
    s = _summary(_records(), max_concurrency=8)
    assert file_name(s, 0) == "00-a@http___h-infqps-concurrency8-model.json"
    assert file_name(s, 1) != file_name(s, 0)
