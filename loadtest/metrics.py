"""Per-request records and their aggregates, with ``vllm bench serve``'s definitions
(vllm/benchmarks/serve.py ``calculate_metrics``, vllm/benchmarks/lib/endpoint_request_func.py).

- Success: HTTP 200 and at least one SSE event that carries ``choices``.
- TTFT: first event with choices − actual send time (a role-only or empty-text chunk counts).
- ITL: gaps between successive events with choices, pooled over requests (per chunk, not per token).
- E2EL: last event with choices − actual send time (a trailing usage-only event does not count).
- TPOT: (E2EL − TTFT) / (output_tokens − 1), only for requests with more than one output token.
- Output tokens: the server's ``usage.completion_tokens``; without usage, the target's tokenizer
  re-counts the generated text (vLLM's fallback; it may count a few tokens more than were generated).
- Prompt tokens: the server's ``usage.prompt_tokens`` when it reports it, else the planned count.
- Duration: first scheduled send to the moment every request has ended (answered, failed or timed out),
  as vLLM times ``gather`` of all requests. Throughputs and goodput divide by it.
- ``max_output_tokens_per_s``: the busiest one-second bucket (from the first send) of chunks with
  choices, counted one token per chunk as vLLM does.
- Goodput: requests meeting every given SLO (ms) per second; TPOT counts as 0 for one-token outputs.
Failed requests are counted by kind and excluded from every latency and token statistic.

Deliberate differences from vLLM's bench, all stricter: a stream carrying an in-band error event, or
ending without any ``finish_reason``, is a failure (``error_event``, ``incomplete``) even after tokens
arrived; vLLM counts both as successes, so a server that cuts answers short would look faster. And a
stream that has begun and then stays silent for the stall timeout (120 s) is a ``timeout``, where vLLM
waits out its 6-hour total; before its first line a request waits as long as ``--timeout`` allows (a
burst's last requests queue for minutes on a CPU server, and vLLM's bench does not cut them either).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds on the run's monotonic clock."""

    index: int
    target_send: float  # when the schedule said to send
    actual_send: float = 0.0
    end: float = 0.0  # when the request ended, whichever way: last byte, error or timeout
    # arrival of each event with choices (out of the repr, as TargetResult.records: a worker process's
    # asyncio.run formats the records it returns)
    chunk_times: list[float] = field(default_factory=list, repr=False)
    generated_text: str = ""
    planned_prompt_tokens: int = 0  # what the workload built, as the target counts it
    prompt_tokens: int = 0  # the server's usage.prompt_tokens, else the planned count
    max_tokens: int = 0
    fixed_output: bool = False  # ignore_eos was sent: the server must return exactly max_tokens
    output_tokens: int = 0
    output_tokens_counted: str = "usage"  # or "tokenizer" (no usage from the server)
    ok: bool = False
    error: str | None = None
    error_kind: str | None = None
    status: int | None = None
    queue_time: float = 0.0  # closed loop: waiting for a free client slot
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it

    @property
    def send_lag(self) -> float:
        return self.actual_send - self.target_send

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.actual_send if self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        return self.chunk_times[-1] - self.actual_send if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1 or self.e2el is None or self.ttft is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def short_output(self) -> bool:
        """A fixed-output request (ignore_eos) answered with fewer tokens than asked: the target ignored it."""
        return self.ok and self.fixed_output and self.output_tokens < self.max_tokens

    @property
    def prompt_mismatch(self) -> bool:
        return self.ok and self.prompt_tokens != self.planned_prompt_tokens

    def to_json(self) -> dict:
        # fields as they are (asdict would deep-copy every chunk time: 3 s of a 262k-token run)
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(ttft=self.ttft, e2el=self.e2el, tpot=self.tpot, send_lag=self.send_lag,
                 short_output=self.short_output)
        return d

    @classmethod
    def from_json(cls, data: dict) -> RequestRecord:
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in data.items() if k in names})


def count_missing_output_tokens(records: list[RequestRecord], count: Callable[[str], int]) -> None:
    """vLLM's fallback for servers that send no usage: re-count the generated text with the tokenizer."""
    for r in records:
        if r.ok and not r.output_tokens:
            r.output_tokens, r.output_tokens_counted = count(r.generated_text), "tokenizer"


def stats(name: str, values_s: Sequence[float] | np.ndarray) -> dict[str, float]:
    """mean/median/std/pXX of ``values_s`` (seconds), in ms under vLLM's key names (0 when empty, as vLLM)."""
    out: dict[str, float] = {}
    arr = np.asarray(values_s, dtype=float) * 1000.0
    if not arr.size:
        arr = np.zeros(1)
    out[f"mean_{name}_ms"] = float(arr.mean())
    out[f"median_{name}_ms"] = float(np.median(arr))
    out[f"std_{name}_ms"] = float(arr.std())
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def summarize(records: list[RequestRecord], duration: float, slos_ms: dict[str, float] | None = None) -> dict:
    """The run's aggregate numbers, under ``vllm bench serve``'s result field names."""
    good = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    in_tokens = sum(r.prompt_tokens for r in good)
    out_tokens = sum(r.output_tokens for r in good)
    duration = max(duration, 1e-9)
    summary = {
        "completed": len(good),
        "failed": len(failed),
        "failures_by_kind": dict(Counter(r.error_kind or "unknown" for r in failed)),
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(good) / duration,
        "request_goodput": sum(meets_slos(r, slos_ms) for r in good) / duration if slos_ms else None,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "max_output_tokens_per_s": max_output_tokens_per_s(good),
        "max_concurrent_requests": peak_concurrency(good),
        "short_outputs": sum(r.short_output for r in records),
        "prompt_tokens_mismatched": sum(r.prompt_mismatch for r in records),
        "output_tokens_counted_by_tokenizer": sum(r.ok and r.output_tokens_counted == "tokenizer" for r in records),
        "cached_token_rate": cached_token_rate(good),
    }
    summary.update(stats("ttft", [t for r in good if (t := r.ttft) is not None]))  # every good one has it
    summary.update(stats("tpot", [r.tpot for r in good if r.tpot is not None]))
    # one array, not a Python list of every gap: a long run has millions (docs/performance.md)
    summary.update(stats("itl", np.concatenate([np.diff(r.chunk_times) for r in good]) if good else []))
    summary.update(stats("e2el", [e for r in good if (e := r.e2el) is not None]))
    summary.update(stats("send_lag", [r.send_lag for r in records]))
    summary.update(stats("client_queue_time", [r.queue_time for r in good]))
    summary.update(stats("e2el_including_client_queue",
                         [e + r.queue_time for r in good if (e := r.e2el) is not None]))
    if slos_ms:
        summary["slos_ms"] = dict(slos_ms)
    return summary


def cached_token_rate(records: list[RequestRecord]) -> float | None:
    """Prompt tokens the server served from its prefix cache / prompt tokens, over the requests whose usage said
    (``prompt_tokens_details.cached_tokens``); None when none did."""
    said = [(r.prompt_tokens, cached) for r in records if (cached := r.cached_tokens) is not None]
    prompt = sum(p for p, _ in said)
    return sum(c for _, c in said) / prompt if said and prompt else None


# The server's own prefix-cache counters (tokens looked up, tokens found): vLLM's, then burstgate's.
PREFIX_CACHE_COUNTERS = (("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
                         ("burstgate:prefix_cache_queries_total", "burstgate:prefix_cache_hits_total"))


def server_hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The server's prefix-cache hit rate over a run, from its /metrics scraped before and after (every series of
    the counters summed, so a gateway in front of several engines counts them all); None without them."""
    def total(samples: dict[str, float], name: str) -> float:
        return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))

    for queries, hits in PREFIX_CACHE_COUNTERS:
        looked_up = total(after, queries) - total(before, queries)
        if looked_up > 0:
            return (total(after, hits) - total(before, hits)) / looked_up
    return None


def meets_slos(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """True when every SLO (keys ttft, tpot, e2el; values in ms) holds; TPOT counts as 0 for one token."""
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
    for key, limit in slos_ms.items():
        if key not in values:
            raise ValueError(f"unknown SLO {key!r}; use ttft, tpot or e2el")
        value = values[key]
        if value is None or value * 1000.0 > limit:
            return False
    return True


def peak_concurrency(records: list[RequestRecord]) -> int:
    """Most requests in flight at once (sweep over send/finish events; a finish precedes a send at a tie)."""
    events = sorted([(r.actual_send, 1) for r in records if r.e2el is not None] +
                    [(r.actual_send + r.e2el, -1) for r in records if r.e2el is not None])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def max_output_tokens_per_s(records: list[RequestRecord]) -> float:
    """Chunks with choices in the busiest whole second counted from the first send (vLLM's definition)."""
    if not records:
        return 0.0
    start = min(r.actual_send for r in records)
    seconds = (np.concatenate([np.asarray(r.chunk_times, dtype=float) for r in records]) - start).astype(np.int64)
    return float(np.bincount(seconds).max()) if len(seconds) else 0.0
