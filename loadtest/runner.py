"""Runs one workload against one target: schedule, send, record, sample the system, summarise.

Every send is awaited at its precomputed target time on the monotonic clock (system-wide on Linux,
so worker processes share it). With ``workers > 1`` the requests are dealt round-robin to processes
that each run their own event loop and HTTP client, all aiming at the same start instant.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing as mp
import queue
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp

from loadtest.client import RequestOptions, Target, new_client, send
from loadtest.metrics import RequestRecord, count_missing_output_tokens, server_hit_rate, summarize
from loadtest.schedule import Schedule, arrival_offsets, offered_rate, used_burstiness
from loadtest.sysmon import Sampler, client_hardware, find_server_process, kv_cache_usage, scrape_metrics
from loadtest.workload import RequestSpec

if TYPE_CHECKING:
    from loadtest.capacity import Capacity

LAG_WARNING_S = 0.010  # p99 send lag above this means the client, not the server, set the pace
START_LEAD_S = 0.2  # time to create every task before the first send is due
TIMER_SLACK_S = 0.0015  # the pacer wakes this early, then yields until a send is due (see _send_all)


@dataclass
class RunConfig:
    schedule: Schedule = Schedule.burst
    rate: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None  # closed loop: at most this many in flight
    duration_s: float | None = None  # stop sending after this long
    think_time_s: float = 0.0  # multi-turn conversations: between an answer and the next question
    seed: int = 0
    slos_ms: dict[str, float] = field(default_factory=dict)
    workers: int = 1
    server_pid: int | None = None
    server_port: int | None = None
    sample_interval_s: float = 0.5
    metrics_interval_s: float = 1.0  # the server's /metrics during the run: each scrape costs the server CPU
    request: RequestOptions = field(default_factory=RequestOptions)


@dataclass
class TargetResult:
    target: Target
    config: RunConfig
    # Out of the repr: asyncio.run formats its finished task's result when it restores the SIGINT handler
    # (signal.signal names the old handler in an enum lookup that fails), and every chunk time of a long run took
    # over a second to repr.
    records: list[RequestRecord] = field(repr=False)
    summary: dict
    samples: list = field(default_factory=list)
    metrics_before: dict = field(default_factory=dict)
    metrics_after: dict = field(default_factory=dict)
    client_hardware: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    server_info: dict | None = None  # a burstgate server's GET /info
    capacity: Capacity | None = None  # the capacity search this point was a probe of (loadtest/capacity.py)


async def run_target(target: Target, specs: list[RequestSpec], cfg: RunConfig,
                     on_done: Callable[[RequestRecord | None], None] | None = None,
                     warmup: Sequence[RequestSpec] = (), count_tokens: Callable[[str], int] | None = None) -> TargetResult:
    """Send ``specs`` to ``target`` as ``cfg`` says; every failure is recorded, nothing raises.

    ``warmup`` requests go first, all at once (under the closed loop's limit), outside the timed window.
    ``count_tokens`` re-counts the output of requests the server sent no usage for."""
    offsets = (_trace_offsets(specs) if cfg.schedule is Schedule.trace
               else arrival_offsets(cfg.schedule, len(specs), cfg.rate, cfg.burstiness, cfg.seed))
    conversational = any(s.conversation is not None for s in specs)
    async with new_client(cfg.request) as client:
        await _warm_up(client, target, warmup, cfg)
        before = await scrape_metrics(client, target.url)
        process = _server_process(target, cfg)
        # the server's KV-cache usage is read while the run goes only from a server that exports it
        sampler = Sampler(process, cfg.sample_interval_s,
                          (client, target.url) if kv_cache_usage(before) is not None else None,
                          cfg.metrics_interval_s)
        sampler.start()
        _freeze_heap()
        try:
            if cfg.workers > 1:
                t0, records = await asyncio.to_thread(_run_in_processes, target, specs, offsets, cfg, on_done)
            elif conversational:
                t0 = time.perf_counter() + START_LEAD_S
                records = await _converse(client, target, specs, offsets, t0, cfg, on_done)
            elif any(s.session is not None for s in specs):
                t0 = time.perf_counter() + START_LEAD_S
                records = await _replay_sessions(client, target, specs, offsets, t0, cfg, on_done)
            else:
                t0 = time.perf_counter() + START_LEAD_S
                records = await _send_all(client, target, specs, offsets, t0, cfg, on_done)
            ended = time.perf_counter()  # every request has ended: answered, failed or timed out
        finally:
            gc.unfreeze()
        samples = await sampler.stop()
        after = await scrape_metrics(client, target.url)
    if count_tokens is not None:
        count_missing_output_tokens(records, count_tokens)
    summary = summarize(records, ended - t0, cfg.slos_ms or None)
    summary.update(url=target.url, model_id=target.model, label=target.label, num_prompts=len(specs),
                   request_rate=cfg.rate or offered_rate(offsets) or "inf",  # a trace's: its mean
                   burstiness=used_burstiness(cfg.schedule, cfg.burstiness),
                   offered_request_rate=offered_rate(offsets), max_concurrency=cfg.concurrency,
                   schedule=cfg.schedule.value, warmup_requests=len(warmup),
                   server_prefix_cache_hit_rate=server_hit_rate(before, after))
    if conversational:
        summary.update(conversation_counts(specs, records, ended - t0))
    return TargetResult(target, cfg, records, summary, samples, before, after, client_hardware(), _warnings(summary))


def _trace_offsets(specs: list[RequestSpec]) -> list[float]:
    """A replayed trace's send times, which every one of its requests carries."""
    offsets = [s.at_s for s in specs if s.at_s is not None]
    if len(offsets) != len(specs):
        raise ValueError("a trace's requests must each carry their send time")
    return offsets


def _freeze_heap() -> None:
    """Keep the garbage collector off the objects already alive (torch, tokenizers: hundreds of thousands, a full
    pass a long pause), so no collection pauses the client mid-run; vLLM's bench does the same (``freeze_gc_heap``)."""
    gc.collect()
    gc.freeze()


async def _warm_up(client: aiohttp.ClientSession, target: Target, warmup: Sequence[RequestSpec], cfg: RunConfig) -> None:
    gate = asyncio.Semaphore(cfg.concurrency or max(len(warmup), 1))

    async def one(spec: RequestSpec) -> None:
        async with gate:
            await send(client, target, spec, RequestRecord(-1, 0.0), cfg.request)

    await asyncio.gather(*(one(s) for s in warmup))


def _warnings(summary: dict) -> list[str]:
    warnings = []
    if summary["p99_send_lag_ms"] > LAG_WARNING_S * 1000:
        warnings.append(f"client fell behind its schedule: p99 send lag {summary['p99_send_lag_ms']:.1f} ms "
                        f"(> {LAG_WARNING_S * 1000:.0f} ms); results may be client-bound, try --workers")
    if summary["short_outputs"]:
        warnings.append(f"{summary['short_outputs']} requests got fewer tokens than max_tokens although ignore_eos "
                        "was sent: the target ignores it, so outputs are not of fixed length")
    if summary["prompt_tokens_mismatched"]:
        warnings.append(f"{summary['prompt_tokens_mismatched']} requests: the server counted other prompt lengths "
                        "than planned (its counts are used); give the target's tokenizer with --tokenizer")
    if summary["output_tokens_counted_by_tokenizer"]:
        warnings.append(f"{summary['output_tokens_counted_by_tokenizer']} requests came without usage: their output "
                        "tokens were re-counted from the text with the client's tokenizer")
    return warnings


def _server_process(target: Target, cfg: RunConfig):
    port = cfg.server_port
    if port is None and cfg.server_pid is None:
        url = urlsplit(target.url)  # a local target: find who listens there
        if url.hostname not in ("127.0.0.1", "localhost", "::1"):
            return None
        port = url.port or (443 if url.scheme == "https" else 80)
    try:
        return find_server_process(cfg.server_pid, port)
    except Exception:  # no permission to list sockets, or the process vanished: sample without it
        return None


async def _converse(client: aiohttp.ClientSession, target: Target, specs: list[RequestSpec], offsets: list[float],
                    t0: float, cfg: RunConfig, on_done=None) -> list[RequestRecord]:
    """Multi-turn conversations: each starts at its arrival (the schedule's offsets, one per conversation) and sends
    its turns one after another, each once the previous one was answered and ``cfg.think_time_s`` has passed, with
    the system prompt, every earlier question and answer, and the new question; a failed turn ends its
    conversation (its later turns are not sent). With ``cfg.concurrency`` at most that many conversations are under
    way at once, a later one waiting for a place (its first turn's queue time)."""
    turns: dict[int, list[int]] = {}
    for i, spec in enumerate(specs):
        assert spec.conversation is not None  # a conversational workload's every request has one
        turns.setdefault(spec.conversation, []).append(i)
    records: list[RequestRecord | None] = [None] * len(specs)
    gate = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else contextlib.nullcontext()

    async def talk(k: int, indices: list[int]) -> None:
        await _sleep_until(t0 + offsets[k])
        waited = time.perf_counter()
        async with gate:
            queued = time.perf_counter() - waited
            first = specs[indices[0]]
            history = [{"role": "system", "content": first.system}] if first.system else []
            for i in indices:
                messages = [*history, {"role": "user", "content": specs[i].prompt}]
                record = records[i] = RequestRecord(i, time.perf_counter())
                record.queue_time, queued = queued, 0.0  # the first turn's wait for a place
                await send(client, target, replace(specs[i], messages=messages), record, cfg.request)
                if on_done is not None:
                    on_done(record)
                if not record.ok:
                    return
                history = [*messages, {"role": "assistant", "content": record.generated_text}]
                await asyncio.sleep(cfg.think_time_s)

    await asyncio.gather(*(talk(k, indices) for k, indices in enumerate(turns.values())))
    return [r for r in records if r is not None]


def conversation_counts(specs: list[RequestSpec], records: list[RequestRecord], duration_s: float) -> dict:
    """A multi-turn run's conversations: how many, how many were answered turn by turn to the end, and those per
    second of the run (the rate a capacity search over conversations compares)."""
    turns = Counter(spec.conversation for spec in specs)
    answered = Counter(specs[r.index].conversation for r in records if r.ok)
    completed = sum(answered[k] == n for k, n in turns.items())
    return {"conversations": len(turns), "completed_conversations": completed,
            "conversation_throughput": completed / duration_s if duration_s > 0 else 0.0}


async def _replay_sessions(client: aiohttp.ClientSession, target: Target, specs: list[RequestSpec],
                           offsets: list[float], t0: float, cfg: RunConfig, on_done=None) -> list[RequestRecord]:
    """A trace with sessions: a session's requests go one after another, each when it is due or once the previous
    one was answered, whichever is later (its send lag counts from then); requests without a session go when due."""
    chains: dict[object, list[int]] = {}
    for i, spec in enumerate(specs):
        chains.setdefault(spec.session if spec.session is not None else ("alone", i), []).append(i)
    records: list[RequestRecord] = []

    async def chain(indices: list[int]) -> None:
        for i in indices:
            due = max(t0 + offsets[i], time.perf_counter())
            await _sleep_until(due)
            record = RequestRecord(i, due)
            records.append(record)
            await send(client, target, specs[i], record, cfg.request)
            if on_done is not None:
                on_done(record)

    await asyncio.gather(*(chain(indices) for indices in chains.values()))
    return sorted(records, key=lambda r: r.index)


async def _sleep_until(when: float) -> None:
    delay = when - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def _send_all(client: aiohttp.ClientSession, target: Target, specs: list[RequestSpec], offsets: list[float],
                    t0: float, cfg: RunConfig, on_done=None, indices: list[int] | None = None) -> list[RequestRecord]:
    indices = indices if indices is not None else list(range(len(specs)))
    gate = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    deadline = t0 + cfg.duration_s if cfg.duration_s else None

    async def one(i: int, due: float) -> RequestRecord | None:
        record = RequestRecord(i, due)
        if gate is None:
            await send(client, target, specs[i], record, cfg.request)
        else:
            waited = time.perf_counter()
            async with gate:
                record.queue_time = time.perf_counter() - waited
                if deadline is not None and time.perf_counter() > deadline:
                    return None
                await send(client, target, specs[i], record, cfg.request)
        if on_done is not None:
            on_done(record)
        return record

    # One pacer starts each request when it is due. asyncio wakes timers through epoll's millisecond
    # timeout, rounded up (up to 1 ms late), so the pacer sleeps to just before the due time and then
    # yields to the loop until it, which keeps sends on time to a fraction of a millisecond. One task per request
    # sleeping on its own would need one spinner each.
    tasks = []
    try:
        for i in sorted(indices, key=lambda i: offsets[i]):
            due = t0 + offsets[i]
            if deadline is not None and due > deadline:
                break  # past the run's duration: never sent
            if (delay := due - time.perf_counter()) > TIMER_SLACK_S:
                await asyncio.sleep(delay - TIMER_SLACK_S)
            while time.perf_counter() < due:
                await asyncio.sleep(0)
            tasks.append(asyncio.create_task(one(i, due)))
        done = await asyncio.gather(*tasks)
    finally:  # a cancelled run leaves no request behind
        for task in tasks:
            task.cancel()
    return [r for r in done if r is not None]


# ------------------------------------------------------------------------------ worker processes
def _run_in_processes(target, specs, offsets, cfg: RunConfig, on_done) -> tuple[float, list[RequestRecord]]:
    """Deal the requests to worker processes; the clock starts once every worker is ready to send
    (spawning and importing takes seconds, which must not count as send lag)."""
    ctx = mp.get_context("spawn")
    events = ctx.Queue()  # ("ready"|"done"|"records", payload) from the workers
    start_at, go = ctx.Value("d", 0.0), ctx.Event()
    # A closed loop's concurrency is split across the workers.
    per_worker = replace(cfg, concurrency=-(-cfg.concurrency // cfg.workers) if cfg.concurrency else None)
    procs = [ctx.Process(target=_worker, args=(target, specs, offsets, per_worker, list(range(w, len(specs), cfg.workers)),
                                                events, start_at, go), daemon=True)
             for w in range(cfg.workers)]
    for p in procs:
        p.start()
    records: list[RequestRecord] = []
    ready = finished = 0
    while finished < len(procs):
        try:
            kind, payload = events.get(timeout=1.0)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                raise RuntimeError("a load-test worker process died") from None
            continue
        if kind == "ready":
            ready += 1
            if ready == len(procs):
                start_at.value = time.perf_counter() + START_LEAD_S
                go.set()
        elif kind == "done":
            if on_done is not None:
                on_done(None)
        else:
            records.extend(payload)
            finished += 1
    for p in procs:
        p.join()
    return start_at.value, sorted(records, key=lambda r: r.index)


def _worker(target, specs, offsets, cfg, indices, events, start_at, go) -> None:
    async def main():
        async with new_client(cfg.request) as client:
            _freeze_heap()
            events.put(("ready", None))
            await asyncio.to_thread(go.wait)
            return await _send_all(client, target, specs, offsets, start_at.value, cfg,
                                   lambda r: events.put(("done", None)), indices)

    events.put(("records", asyncio.run(main())))


def result_to_json(result: TargetResult) -> dict:
    """Everything about one run but its per-request records."""
    return {"summary": result.summary, "server_info": result.server_info, "client_hardware": result.client_hardware,
            "warnings": result.warnings, "capacity": result.capacity.to_json() if result.capacity else None,
            "samples": [asdict(s) for s in result.samples], "metrics_before": result.metrics_before,
            "metrics_after": result.metrics_after}
