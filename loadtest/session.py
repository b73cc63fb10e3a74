"""One ``loadtest run``: every target at every sweep point, each measurement on prompts of its own.

Per target, before measuring: the server's hardware (its ``GET /info``, or declared as
``URL#MODEL@HARDWARE``), and who counts prompt tokens (the server's ``/tokenize``, else the target's local
tokenizer). Per target and point: fresh prompts fitted to the asked lengths as that target counts them,
and a warm-up on other prompts of the same shape. Prompts are salted per target and per point (a server's
prefix cache never serves a repeat) and per run unless ``seed`` is given, which makes the run reproducible.
"""

from __future__ import annotations

import secrets
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import aiohttp
import numpy as np

from loadtest.capacity import Capacity, search, sweep
from loadtest.client import Target
from loadtest.metrics import RequestRecord
from loadtest.runner import RunConfig, TargetResult, run_target
from loadtest.schedule import Schedule, offered_rate
from loadtest.trace import MOONCAKE_BLOCK_SIZE, read_trace, trace_specs
from loadtest.trace import describe as describe_trace
from loadtest.workload import (
    LocalCounter,
    PromptCounter,
    RequestSpec,
    ServerCounter,
    conversations,
    fit,
    from_file,
    load_tokenizer,
    paper_preset,
    synthetic,
)

Length = int | tuple[int, int]
Progress = Callable[[str, int], Callable[[RequestRecord | None], None]]


@dataclass
class Workload:
    """The shape of the requests every target gets: synthetic lengths, the paper's preset, or a dataset."""

    requests: int
    input_len: Length
    output_len: Length
    dataset: Path | None = None
    prefix_len: int = 0
    num_prefixes: int = 1
    paper: bool = False  # arXiv 2311.03687: 1000 x 512 tokens, burst, fixed output
    users: int = 0  # multi-turn conversations (workload.conversations): this many, of ``turns`` questions each
    turns: int = 1
    system_prompt_len: int = 0
    question_len: int = 0
    user_history_len: int = 0  # each conversation's own context before its first question
    trace: Path | None = None  # a trace to replay (loadtest/trace.py), at its own times x ``time_scale``
    trace_block_size: int = MOONCAKE_BLOCK_SIZE
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.trace is not None:
            self._trace = read_trace(self.trace, self.trace_block_size)
            self.requests = len(self._trace)

    @property
    def conversational(self) -> bool:
        return self.users > 0

    @property
    def chained(self) -> bool:
        """Whether some requests wait for an earlier one's answer: conversations, or a trace's sessions."""
        return self.conversational or (self.trace is not None and any(r.session is not None for r in self._trace))

    @property
    def exact_lengths(self) -> bool:
        """Whether prompts are fitted to planned lengths (else only counted: a dataset's or a trace's texts)."""
        if self.trace is not None:
            return self._trace[0].prompt is None
        return self.dataset is None

    def build(self, tokenizer, seed: int, rate: float | None = None) -> list[RequestSpec]:
        """The requests of one point; ``rate``: a trace's times scaled to this mean rate (a sweep's or a capacity
        search's point), else by ``time_scale``."""
        if self.trace is not None:
            scale = self.time_scale if rate is None else self.trace_rate() / rate
            return trace_specs(self._trace, tokenizer, self.trace_block_size, seed, scale)
        if self.conversational:
            output = self.output_len if isinstance(self.output_len, int) else self.output_len[1]
            return conversations(tokenizer, self.users, self.turns, self.system_prompt_len, self.question_len,
                                 output, seed, self.user_history_len)
        if self.paper:
            return paper_preset(tokenizer, self.output_len, self.requests, seed)
        if self.dataset is not None:
            fixed = self.output_len if isinstance(self.output_len, int) else None
            return from_file(self.dataset, tokenizer, self.requests, fixed, seed)
        return synthetic(tokenizer, self.requests, self.input_len, self.output_len, seed, self.prefix_len,
                         self.num_prefixes)

    def trace_rate(self) -> float:
        """The trace's mean rate at its own times (ValueError when every request is due at once)."""
        rate = offered_rate([r.at_s for r in self._trace])
        if rate is None:
            raise ValueError("every request of the trace is due at once: it has no rate to scale")
        return rate

    def warmup(self, tokenizer, seed: int, n: int, measured: list[RequestSpec]) -> list[RequestSpec]:
        """``n`` other prompts of the measured shape (for a dataset: its median lengths)."""
        if n == 0:
            return []
        if self.conversational:
            first_turn = self.system_prompt_len + self.user_history_len + self.question_len
            return synthetic(tokenizer, n, max(1, first_turn), measured[0].max_tokens, seed)
        if self.trace is not None:
            lengths = sorted(s.prompt_tokens for s in measured)
            return synthetic(tokenizer, n, max(1, lengths[len(lengths) // 2]),
                             int(statistics.median(s.max_tokens for s in measured)), seed)
        if self.dataset is None:
            return synthetic(tokenizer, n, self.input_len, self.output_len, seed)
        length = max(1, int(statistics.median(s.prompt_tokens for s in measured)))
        return synthetic(tokenizer, n, length, int(statistics.median(s.max_tokens for s in measured)), seed)

    def describe(self) -> str:
        if self.trace is not None:
            return describe_trace(self.trace, self._trace, self.trace_block_size, self.time_scale)
        if self.conversational:
            history = f" history={self.user_history_len}" if self.user_history_len else ""
            return (f"multi-turn users={self.users} turns={self.turns} system={self.system_prompt_len}{history} "
                    f"question={self.question_len} out={_text(self.output_len)}")
        if self.paper:
            return f"paper preset n={self.requests} in=512 out={_text(self.output_len)}"
        if self.dataset is not None:
            return f"dataset={self.dataset.name} n={self.requests} out={_text(self.output_len)}"
        desc = f"synthetic n={self.requests} in={_text(self.input_len)} out={_text(self.output_len)}"
        return desc + (f" prefix={self.prefix_len}x{self.num_prefixes}" if self.prefix_len else "")


@dataclass
class CapacitySearch:
    """Search each target for its capacity at these SLOs (loadtest/capacity.py)."""

    slos_ms: dict[str, float]
    attainment: float = 0.9
    precision: float = 0.05


@dataclass
class Session:
    """What one ``loadtest run`` measures: every target at every point, or, from ``points[0]``, guidellm's sweep
    of ``sweep`` constant rates, or a capacity search."""

    targets: list[Target]
    workload: Workload
    points: list[RunConfig]
    warmup: int = 4  # requests per target and point, before the timed window
    seed: int | None = None  # None: fresh prompts every run
    sweep: int = 0
    capacity: CapacitySearch | None = None


async def run_session(session: Session, progress: Progress | None = None,
                      warn: Callable[[str], None] = lambda _: None) -> list[TargetResult]:
    """Measure every target, one after another; a capacity search's results carry its ``Capacity``."""
    base_seed = session.seed if session.seed is not None else secrets.randbits(32)
    tokenizers = {path: load_tokenizer(path) for path in {t.tokenizer for t in session.targets}}
    results = []
    for i, target in enumerate(session.targets):
        results += await _measure_target(session, i, target, tokenizers[target.tokenizer], base_seed, progress, warn)
    return results


async def _measure_target(session: Session, index: int, target: Target, tokenizer, base_seed: int,
                          progress: Progress | None, warn: Callable[[str], None]) -> list[TargetResult]:
    """One target at every point the session asks for, or as its sweep or capacity search goes."""
    base = session.points[0]
    measured: list[TargetResult] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        hardware, source, info = await server_hardware(http, target, warn)
        counter = await prompt_counter(http, target, base.request.endpoint == "chat", tokenizer)

        async def measure(cfg: RunConfig, role: str = "") -> TargetResult:
            point = len(measured)
            result = await _measure(session, target, tokenizer, counter,
                                    replace(cfg, seed=prompt_seed(base_seed, index, point)),
                                    prompt_seed(base_seed, index, point, 1), role, progress)
            result.summary.update(hardware=hardware, hardware_source=source)
            result.server_info = info
            measured.append(result)
            return result

        if session.capacity is not None:
            c = session.capacity
            _, found = await search(measure, base, c.slos_ms, c.attainment, c.precision)
            for result in measured:
                result.capacity = found
        elif session.sweep:
            await sweep(measure, base, session.sweep)
        else:
            for cfg in session.points:
                await measure(cfg)
    return measured


async def _measure(session: Session, target: Target, tokenizer, counter: PromptCounter, cfg: RunConfig,
                   warmup_seed: int, role: str, progress: Progress | None) -> TargetResult:
    """One point: fresh prompts fitted to the target's counts, a warm-up, the timed run, its settings noted."""
    specs = session.workload.build(tokenizer, cfg.seed, cfg.rate if cfg.schedule is Schedule.trace else None)
    if not session.workload.conversational:  # a turn's length is its history's: the server counts it
        specs = await fit(specs, counter, exact=session.workload.exact_lengths)
    warm = session.workload.warmup(tokenizer, warmup_seed, session.warmup, specs)
    point = point_desc(cfg) + (f" ({role})" if role else "")
    on_done = progress(f"{target.label}{point}", len(specs)) if progress else None
    result = await run_target(target, specs, cfg, on_done, warm,
                              lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    endpoint = cfg.request.endpoint
    result.summary.update(
        date=_now(), tokenizer_id=str(target.tokenizer or "SmolLM2-135M-Instruct (embedded)"),
        prompt_lengths_counted_by=counter.name, endpoint=endpoint,
        backend="openai-chat" if endpoint == "chat" else "openai",
        ignore_eos=cfg.request.ignore_eos, temperature=cfg.request.temperature,
        workload=session.workload.describe(), point=point, point_role=role, prompt_seed=cfg.seed,
        prompts=_prompts_note(session))
    return result


async def server_hardware(http: aiohttp.ClientSession, target: Target,
                          warn: Callable[[str], None]) -> tuple[str, str, dict | None]:
    """(hardware, where it came from, the server's /info) for the leaderboard: declared wins over reported."""
    info = await server_info(http, target)
    reported = info.get("hardware") if info else None
    if target.hardware:
        if reported and reported != target.hardware:
            warn(f"{target.label}: declared hardware {target.hardware!r}, the server reports {reported!r}")
        return target.hardware, "declared", info
    if reported:
        return reported, "server /info", info
    warn(f"{target.label}: the server does not report its hardware; declare it as URL#MODEL@HARDWARE "
         "so its runs rank with their peers")
    return "unknown", "unknown", info


async def server_info(http: aiohttp.ClientSession, target: Target) -> dict | None:
    """A burstgate server's ``GET /info`` (devices, deployments); None from other servers."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    try:
        async with http.get(f"{target.url}/info", headers=headers) as r:
            info = await r.json() if r.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None
    return info if isinstance(info, dict) and "devices" in info else None


async def prompt_counter(http: aiohttp.ClientSession, target: Target, chat: bool, tokenizer) -> PromptCounter:
    """The server's /tokenize when it answers, else the target's local tokenizer."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    server = ServerCounter(http, target.url, target.model, chat, headers)
    if await server.works():
        return server
    return LocalCounter(tokenizer, chat, f"local tokenizer {target.tokenizer or 'SmolLM2-135M-Instruct (embedded)'}")


def prompt_seed(base: int, target: int, point: int, purpose: int = 0) -> int:
    return int(np.random.SeedSequence([base, target, point, purpose]).generate_state(1)[0])


def point_desc(cfg: RunConfig) -> str:
    desc = f" schedule={cfg.schedule.value}"
    if cfg.rate is not None:
        desc += f" rate={cfg.rate:g}"
    if cfg.schedule is Schedule.gamma:
        desc += f" burstiness={cfg.burstiness:g}"
    if cfg.concurrency:
        desc += f" concurrency={cfg.concurrency}"
    if cfg.duration_s:
        desc += f" duration={cfg.duration_s:g}s"
    return desc


def workload_key(summary: dict, cfg: RunConfig) -> str:
    """What the leaderboard compares like with like on: endpoint, shape, output rule, sampling and load."""
    return _requests_key(summary) + point_desc(cfg)


def capacity_key(summary: dict, capacity: Capacity) -> str:
    """What capacities compare on: the requests' shape and how the probes' requests arrive (not the rates, which
    the search chose)."""
    return f"{_requests_key(summary)} arrivals={capacity.arrivals}"


def _requests_key(summary: dict) -> str:
    key = f"{summary['endpoint']} {summary['workload']} ignore_eos={summary['ignore_eos']}"
    if summary["temperature"] is not None:
        key += f" temperature={summary['temperature']:g}"
    return key


def _prompts_note(session: Session) -> str:
    if session.workload.trace is not None and not session.workload.exact_lengths:
        return "the trace's, as given (a prefix cache may serve repeats)"
    if session.workload.dataset is not None:  # a dataset's prompts are what they are: only their order changes
        return "the dataset's, shuffled per target and point (a prefix cache may serve repeats)"
    fresh = "reproducible from --seed" if session.seed is not None else "fresh for this run"
    return fresh + ", distinct per target and point"


def _now() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def _text(length: Length) -> str:
    return str(length) if isinstance(length, int) else f"{length[0]}:{length[1]}"
