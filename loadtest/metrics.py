"""Per-request records and their aggregates, with vLLM's ``vllm bench serve`` definitions.

- TTFT: first chunk that carries choices − actual send time.
- ITL: gaps between successive token-bearing chunks, pooled over requests (per chunk, not per token).
- E2EL: last token-bearing chunk − actual send time (a trailing usage-only chunk does not count).
- TPOT: (E2EL − TTFT) / (output_tokens − 1), only for requests with more than one output token.
- Throughputs divide by the run's duration: first scheduled send to last completion.
- Goodput: requests meeting every given SLO (ms) per second of duration.
Failed requests are counted by kind and excluded from every latency statistic.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds on the run's monotonic clock."""

    index: int
    target_send: float  # when the schedule said to send
    actual_send: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token-bearing chunk
    first_response: float | None = None  # first chunk with choices (even if its text is empty)
    prompt_tokens: int = 0
    output_tokens: int = 0
    ok: bool = False
    error: str | None = None
    error_kind: str | None = None
    status: int | None = None
    queue_time: float = 0.0  # closed-loop waiting for a free client slot

    @property
    def send_lag(self) -> float:
        return self.actual_send - self.target_send

    @property
    def ttft(self) -> float | None:
        first = self.first_response if self.first_response is not None else (self.chunk_times or [None])[0]
        return None if first is None else first - self.actual_send

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

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(ttft=self.ttft, e2el=self.e2el, tpot=self.tpot, send_lag=self.send_lag)
        return d


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    """mean/median/std/pXX of ``values_s`` (seconds), reported in ms under vLLM's key names."""
    out: dict[str, float] = {}
    arr = np.asarray(values_s, dtype=float) * 1000.0
    empty = arr.size == 0
    out[f"mean_{name}_ms"] = 0.0 if empty else float(arr.mean())
    out[f"median_{name}_ms"] = 0.0 if empty else float(np.median(arr))
    out[f"std_{name}_ms"] = 0.0 if empty else float(arr.std())
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = 0.0 if empty else float(np.percentile(arr, p))
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
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "max_concurrent_requests": peak_concurrency(good),
    }
    summary.update(_stats("ttft", [r.ttft for r in good if r.ttft is not None]))
    summary.update(_stats("tpot", [r.tpot for r in good if r.tpot is not None]))
    summary.update(_stats("itl", [gap for r in good for gap in r.itls]))
    summary.update(_stats("e2el", [r.e2el for r in good if r.e2el is not None]))
    summary.update(_stats("send_lag", [r.send_lag for r in records]))
    summary.update(_stats("queue_time", [r.queue_time for r in records]))
    if slos_ms:
        summary["request_goodput"] = sum(meets_slos(r, slos_ms) for r in good) / duration
        summary["slos_ms"] = dict(slos_ms)
    return summary


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
    """Most requests in flight at once (sweep over send/finish events)."""
    events = sorted([(r.actual_send, 1) for r in records if r.e2el is not None] +
                    [(r.actual_send + r.e2el, -1) for r in records if r.e2el is not None], key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak
