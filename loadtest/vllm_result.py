"""One target's run as ``vllm bench serve``'s result JSON, so tools built for vLLM's files read ours unchanged.

The keys, their order and their meaning are those vLLM 0.32.0 writes (vllm/benchmarks/serve.py, ``main_async``
and ``benchmark``) for ``vllm bench serve --save-result --save-detailed --percentile-metrics
ttft,tpot,itl,e2el --metric-percentiles 50,90,95,99``; the client-queue statistics appear, as there, only
with a concurrency limit (and the queue-inclusive E2EL only with a finite rate as well).
"""

from __future__ import annotations

import math

from loadtest.metrics import PERCENTILES, RequestRecord, stats

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def vllm_result(summary: dict, records: list[RequestRecord]) -> dict:
    """The result JSON ``vllm bench serve`` would have written for this run."""
    records = sorted(records, key=lambda r: r.index)
    out = {"date": summary["date"], "endpoint_type": summary["backend"], "backend": summary["backend"],
           "label": summary["label"], "model_id": summary["model_id"], "tokenizer_id": summary["tokenizer_id"],
           "num_prompts": summary["num_prompts"], "request_rate": summary["request_rate"],
           "burstiness": summary["burstiness"], "max_concurrency": summary["max_concurrency"]}
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput"):
        out[key] = summary[key]
    out.update({
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens if r.ok else 0 for r in records],
        "ttfts": [r.ttft or 0.0 for r in records],
        "itls": [r.itls for r in records],
        "latencies": [r.e2el or 0.0 for r in records],
        "start_times": [r.actual_send for r in records],
        "queue_times": [r.queue_time for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": ["" if r.ok else f"{r.error_kind}: {r.error}" for r in records],
        "max_output_tokens_per_s": summary["max_output_tokens_per_s"],
        "max_concurrent_requests": summary["max_concurrent_requests"],
        "rtfx": 0.0,  # speech benchmarks only
    })
    for metric in LATENCY_METRICS:
        out.update({k: summary[k] for k in _stat_keys(metric)})
    if summary["max_concurrency"] is not None:
        good = [r for r in records if r.ok]
        out.update(stats("client_queue_time", [r.queue_time for r in good]))
        if summary["request_rate"] != "inf":
            out.update(stats("e2el_including_client_queue",
                             [e + r.queue_time for r in good if (e := r.e2el) is not None]))
    return out


def file_name(summary: dict, index: int) -> str:
    """vLLM's ``{label}-{rate}qps[-concurrencyN]-{model}.json``, numbered so several targets never collide."""
    rate = summary["request_rate"]
    rate = "inf" if rate == "inf" or (isinstance(rate, float) and math.isinf(rate)) else f"{float(rate)}"
    concurrency = f"-concurrency{summary['max_concurrency']}" if summary["max_concurrency"] is not None else ""
    model = summary["model_id"].split("/")[-1]
    return _safe(f"{index:02d}-{summary['label']}-{rate}qps{concurrency}-{model}") + ".json"


def _stat_keys(metric: str) -> list[str]:
    return [f"{s}_{metric}_ms" for s in ("mean", "median", "std")] + [f"p{p}_{metric}_ms" for p in PERCENTILES]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.@" else "_" for c in name)
