"""``burstgate loadtest run | report | leaderboard | mock-server``."""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import replace
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from backends.base import BackendError
from gateway.cli_help import HelpCommand, HelpGroup, given
from loadtest import report, store, sysmon
from loadtest.client import RequestOptions, Target
from loadtest.extras import MissingExtraError, require
from loadtest.recommend import Recommendation, describe_settings, describe_slos, recommend, select
from loadtest.runner import RunConfig, TargetResult, result_to_json
from loadtest.schedule import Schedule, check
from loadtest.session import CapacitySearch, Session, Workload, capacity_key, run_session, workload_key

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None, cls=HelpGroup)
console = Console()

# The sections of `loadtest run --help`.
TARGETS, WORKLOAD, CONVERSATIONS, TRACES = "Targets", "Workload", "Multi-turn conversations", "Trace replay"
ARRIVALS, CAPACITY, OUTPUT = "Arrivals and sweeps", "Goodput and capacity at an SLO", "Output"

PAPER: dict[str, Any] = {"requests": 1000, "input_len": "512", "schedule": Schedule.burst}  # arXiv 2311.03687


class Endpoint(StrEnum):
    completions = "completions"
    chat = "chat"


class Preset(StrEnum):
    paper = "paper"


def _length(text: str, name: str) -> int | tuple[int, int]:
    """``512`` or ``32:512`` (inclusive range)."""
    try:
        if ":" in text:
            low, high = (int(x) for x in text.split(":", 1))
            if not 1 <= low <= high:
                raise ValueError
            return low, high
        value = int(text)
        if value < 1:
            raise ValueError
        return value
    except ValueError:
        raise typer.BadParameter(f"{text!r}: give a positive integer or LOW:HIGH", param_hint=name) from None


def _numbers(text: str, name: str, kind: type) -> list:
    """A comma list of positive numbers, e.g. ``1,4,16``."""
    try:
        values = [kind(x) for x in text.split(",")]
        if not values or any(not v > 0 for v in values):
            raise ValueError
        return values
    except ValueError:
        raise typer.BadParameter(f"{text!r}: give positive {kind.__name__}s separated by commas, e.g. 1,4,16",
                                 param_hint=name) from None


def _slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        try:
            if key not in ("ttft", "tpot", "e2el") or float(value) < 0:
                raise ValueError
        except ValueError:
            raise typer.BadParameter(f"{item!r}: use ttft:MS, tpot:MS or e2el:MS", param_hint="--goodput") from None
        slos[key] = float(value)
    return slos


def _paper_conflicts(ctx: typer.Context, output_len: str) -> list[str]:
    """Options that would change the paper's workload (1000 x 512 tokens, burst, fixed output, ignore_eos)."""
    names = ("requests", "input_len", "schedule", "rate", "burstiness", "concurrency", "sweep_concurrency",
             "sweep_rate", "duration", "dataset", "prefix_len", "num_prefixes", "users")
    bad = [f"--{n.replace('_', '-')}" for n in names if given(ctx, n) and ctx.params[n] != PAPER.get(n, object())]
    if ":" in output_len:
        bad.append("--output-len LOW:HIGH (the paper's output length is fixed)")
    if ctx.params["ignore_eos"] is False:
        bad.append("--no-ignore-eos (the paper's outputs are of fixed length)")
    return bad


def _unused(ctx: typer.Context) -> str | None:
    """Options the rest of the command line would leave without effect (nothing accepted and ignored)."""
    p = ctx.params
    if p["trace"] is not None:
        shaped = ("requests", "input_len", "output_len", "dataset", "prefix_len", "users", "schedule", "rate",
                  "burstiness", "sweep_rate", "sweep_concurrency", "preset")
        if named := [f"--{n.replace('_', '-')}" for n in shaped if given(ctx, n)]:
            return f"{', '.join(named)}: a --trace sets its own requests, lengths and times (--time-scale stretches them)"
    elif given(ctx, "time_scale") or given(ctx, "trace_block_size") or p["schedule"] is Schedule.trace:
        return "--time-scale, --trace-block-size and --schedule trace replay a --trace: add one"
    if p["sweep"] or p["capacity"]:
        if p["sweep"] and p["capacity"]:
            return "--sweep and --capacity each choose the rates: give one"
        if named := [f"--{n.replace('_', '-')}" for n in ("rate", "concurrency", "sweep_rate", "sweep_concurrency",
                                                          "preset") if given(ctx, n)]:
            return f"{', '.join(named)}: --sweep and --capacity choose the rates themselves (of conversations with --users)"
        if given(ctx, "time_scale"):
            return "--time-scale: --sweep and --capacity scale a --trace's times to each rate they try"
        if p["capacity"] and not p["goodput"]:
            return "--capacity searches the highest rate meeting an SLO: add --goodput ttft:MS (or tpot:MS, e2el:MS)"
    if not p["capacity"] and (given(ctx, "attainment") or given(ctx, "precision")):
        return "--attainment and --precision shape a --capacity search: add --capacity"
    if p["dataset"] is not None and (given(ctx, "input_len") or p["prefix_len"]):
        return "--input-len and --prefix-len shape synthetic prompts, not a --dataset's"
    if given(ctx, "num_prefixes") and not p["prefix_len"]:
        return "--num-prefixes needs --prefix-len"
    if p["sweep_rate"] and p["rate"] is not None:
        return "--sweep-rate sets the rate of each point: drop --rate"
    if p["sweep_concurrency"] and p["concurrency"] is not None:
        return "--sweep-concurrency sets the concurrency of each point: drop --concurrency"
    conversational = ("turns", "system_prompt_len", "user_history_len", "question_len", "think_time")
    if p["users"] and (given(ctx, "requests") or given(ctx, "input_len") or p["dataset"] or p["prefix_len"]):
        return "--users sends --users x --turns conversation turns: drop --requests, --input-len, --dataset, --prefix-len"
    if not p["users"] and any(given(ctx, n) for n in conversational):
        return ("--turns, --system-prompt-len, --user-history-len, --question-len and --think-time shape "
                "conversations: add --users")
    if p["users"] and p["endpoint"] is not Endpoint.chat:
        return "--users sends multi-turn chat: add --endpoint chat"
    # a sweep and a capacity search pace their own points (one at a time, constant rates): --duration bounds each
    paced = p["concurrency"] or p["sweep_concurrency"] or p["sweep_rate"] or p["sweep"] or p["capacity"]
    if p["duration"] and p["schedule"] is Schedule.burst and not paced:
        return "--duration stops later sends, but a burst sends everything at t=0: add --concurrency or a rate"
    return None


@app.command(cls=HelpCommand, short_help="Run one workload against every target and compare them.", epilog="""
# the paper's burst (1000 prompts x 512 tokens at once) against one server
burstgate loadtest run --url http://127.0.0.1:8000 \\
    --model SmolLM2-135M-Instruct --preset paper --output-len 128

# two servers side by side: a concurrency sweep, goodput under two SLOs
burstgate loadtest run \\
    --target native=http://127.0.0.1:8000#SmolLM2-135M-Instruct \\
    --target vllm=http://127.0.0.1:8200#smollm2 \\
    --sweep-concurrency 1,8,32 --goodput ttft:2000 --goodput tpot:100

# the highest rate at which 90% of requests meet every SLO
burstgate loadtest run --url http://127.0.0.1:8000 --model smollm2 \\
    --capacity --goodput ttft:1000 --goodput tpot:50

# a Mooncake trace replayed at twice its speed
burstgate loadtest run --url http://127.0.0.1:8000 --model smollm2 \\
    --trace mooncake.jsonl --time-scale 0.5
""")
def run(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option(metavar="URL", help="Base URL shared by every --model.", rich_help_panel=TARGETS)] = None,
    model: Annotated[list[str] | None, typer.Option(metavar="NAME", help="Model name at --url; repeat to compare several.", rich_help_panel=TARGETS)] = None,
    hardware: Annotated[str | None, typer.Option(
        metavar="TEXT", help="The --url server's hardware, for the leaderboard (a burstgate server reports its own).", rich_help_panel=TARGETS)] = None,
    target: Annotated[list[str] | None, typer.Option(
        metavar="[LABEL=]URL#MODEL[@HARDWARE]", help="A target; repeatable. LABEL names it in reports (default "
        "MODEL@URL); HARDWARE declares the server's, for servers without burstgate's GET /info.", rich_help_panel=TARGETS)] = None,
    api_key: Annotated[str | None, typer.Option(envvar="BURSTGATE_LOADTEST_API_KEY", metavar="KEY",
                                                help="Bearer key sent to every target.", rich_help_panel=TARGETS)] = None,
    requests: Annotated[int, typer.Option(min=1, metavar="N", help="Requests per target and sweep point.", rich_help_panel=WORKLOAD)] = 100,
    input_len: Annotated[str, typer.Option(metavar="N|LOW:HIGH",
                                           help="Prompt tokens as the target counts them (chat template included).", rich_help_panel=WORKLOAD)] = "512",
    output_len: Annotated[str, typer.Option(metavar="N|LOW:HIGH", help="max_tokens per request.", rich_help_panel=WORKLOAD)] = "128",
    preset: Annotated[Preset | None, typer.Option(
        help="paper: arXiv 2311.03687's 1000 prompts x 512 tokens in one burst, fixed output; refuses options "
        "that would change it.", rich_help_panel=WORKLOAD)] = None,
    dataset: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, metavar="FILE",
                                                 help="Prompts from JSONL, ShareGPT or Alpaca JSON.", rich_help_panel=WORKLOAD)] = None,
    tokenizer: Annotated[list[str] | None, typer.Option(
        metavar="PATH", help="Local tokenizer (HF dir or .gguf) for targets without /tokenize and for output "
        "counts without usage: once for all targets, or once per target in order (default: embedded SmolLM2).", rich_help_panel=TARGETS)] = None,
    prefix_len: Annotated[int, typer.Option(min=0, metavar="N", help="Shared prefix tokens (prefix-caching workloads).", rich_help_panel=WORKLOAD)] = 0,
    num_prefixes: Annotated[int, typer.Option(min=1, metavar="N", help="Distinct shared prefixes.", rich_help_panel=WORKLOAD)] = 1,
    users: Annotated[int, typer.Option(min=0, metavar="N", help="Multi-turn chat: this many conversations, each "
                                       "turn carrying the whole history (needs --endpoint chat).", rich_help_panel=CONVERSATIONS)] = 0,
    turns: Annotated[int, typer.Option(min=1, metavar="N", help="Questions per conversation.", rich_help_panel=CONVERSATIONS)] = 1,
    system_prompt_len: Annotated[int, typer.Option(min=0, metavar="N", help="Multi-turn: tokens of the system "
                                                   "prompt every conversation shares.", rich_help_panel=CONVERSATIONS)] = 0,
    user_history_len: Annotated[int, typer.Option(min=0, metavar="N", help="Multi-turn: tokens of each "
                                                  "conversation's own context before its first question (earlier "
                                                  "history, a document: production-stack's --user-history-prompt).",
                                                  rich_help_panel=CONVERSATIONS)] = 0,
    question_len: Annotated[int, typer.Option(min=1, metavar="N", help="Multi-turn: tokens of each question.", rich_help_panel=CONVERSATIONS)] = 64,
    think_time: Annotated[float, typer.Option(min=0, metavar="S", help="Multi-turn: seconds between an answer "
                                              "and the next question.", rich_help_panel=CONVERSATIONS)] = 0.0,
    trace: Annotated[Path | None, typer.Option(
        exists=True, dir_okay=False, metavar="FILE", help="Replay a JSONL trace (Mooncake's, or timestamp + prompt or "
        "input_length + output_length [+ session_id]) at its own times.", rich_help_panel=TRACES)] = None,
    time_scale: Annotated[float, typer.Option(min=0.0001, metavar="F", help="Multiplies a trace's times (0.5: "
                                              "twice as fast).", rich_help_panel=TRACES)] = 1.0,
    trace_block_size: Annotated[int, typer.Option(min=1, metavar="N", help="Prompt tokens per trace hash id "
                                                  "(Mooncake: 512).", rich_help_panel=TRACES)] = 512,
    schedule: Annotated[Schedule, typer.Option(help="Arrival schedule.", rich_help_panel=ARRIVALS)] = Schedule.burst,
    rate: Annotated[float | None, typer.Option(metavar="REQ/S", help="Requests/s for poisson, gamma and constant (conversations/s with --users).", rich_help_panel=ARRIVALS)] = None,
    burstiness: Annotated[float, typer.Option(metavar="SHAPE", help="Gamma shape for --schedule gamma (< 1 burstier).", rich_help_panel=ARRIVALS)] = 1.0,
    concurrency: Annotated[int | None, typer.Option(min=1, metavar="N", help="Closed loop: at most N in flight (conversations under way with --users).", rich_help_panel=ARRIVALS)] = None,
    sweep_concurrency: Annotated[str | None, typer.Option(metavar="N,N,...", help="Concurrencies to sweep.", rich_help_panel=ARRIVALS)] = None,
    sweep_rate: Annotated[str | None, typer.Option(metavar="R,R,...", help="Rates to sweep (poisson unless --schedule).", rich_help_panel=ARRIVALS)] = None,
    sweep: Annotated[int, typer.Option(min=0, metavar="N", help="guidellm's sweep: synchronous, throughput, then N "
                                       "constant rates evenly between them.", rich_help_panel=ARRIVALS)] = 0,
    capacity: Annotated[bool, typer.Option("--capacity", help="Search the highest rate meeting every --goodput SLO "
                                           "(see --attainment, --precision).", rich_help_panel=CAPACITY)] = False,
    attainment: Annotated[float, typer.Option(min=0.01, max=1.0, metavar="SHARE", help="--capacity: the share of "
                                              "requests that must meet every SLO.", rich_help_panel=CAPACITY)] = 0.9,
    precision: Annotated[float, typer.Option(min=0.001, max=0.5, metavar="REL", help="--capacity: stop when the "
                                             "first failing rate is within this of the answer.", rich_help_panel=CAPACITY)] = 0.05,
    duration: Annotated[float | None, typer.Option(min=0.001, metavar="S", help="Stop sending after this many seconds.", rich_help_panel=ARRIVALS)] = None,
    warmup: Annotated[int, typer.Option(min=0, metavar="N",
                                        help="Untimed requests (other prompts, same shape) before each measurement.", rich_help_panel=ARRIVALS)] = 4,
    endpoint: Annotated[Endpoint, typer.Option(help="OpenAI route to load.", rich_help_panel=WORKLOAD)] = Endpoint.completions,
    temperature: Annotated[float | None, typer.Option(
        metavar="T", help="Sampling temperature sent with every request (default: none sent, the server decides).", rich_help_panel=WORKLOAD)] = None,
    ignore_eos: Annotated[bool | None, typer.Option(
        "--ignore-eos/--no-ignore-eos", show_default="on for synthetic prompts, off for datasets",
        help="Ask for exactly max_tokens (vLLM extension).", rich_help_panel=WORKLOAD)] = None,
    timeout: Annotated[float, typer.Option(min=0.001, metavar="S", help="Per-request timeout.", rich_help_panel=ARRIVALS)] = 600.0,
    goodput: Annotated[list[str] | None, typer.Option(metavar="KEY:MS", help="SLO for goodput (ttft, tpot or e2el in ms); "
                                                                      "repeatable.", rich_help_panel=CAPACITY)] = None,
    workers: Annotated[int, typer.Option(min=1, metavar="N", help="Client processes (when one cannot keep up).", rich_help_panel=ARRIVALS)] = 1,
    server_pid: Annotated[int | None, typer.Option(metavar="PID", help="Sample this local server process's CPU/RSS.", rich_help_panel=OUTPUT)] = None,
    seed: Annotated[int | None, typer.Option(
        metavar="N", help="Makes prompts and schedules reproducible (default: fresh prompts every run).", rich_help_panel=WORKLOAD)] = None,
    out: Annotated[Path, typer.Option(metavar="DIR", help="Root of the output folders: each run writes a new "
                                                          "DIR/<run id>/.", rich_help_panel=OUTPUT)] = Path("results/loadtest"),
    db: Annotated[Path | None, typer.Option(dir_okay=False, metavar="FILE",
                                            help="SQLite results store (default: the user's data dir).", rich_help_panel=OUTPUT)] = None,
    plots: Annotated[bool, typer.Option(help="Write PNG plots and report.html.", rich_help_panel=OUTPUT)] = True,
) -> None:
    """Run the same workload against every target, one after another, and compare them."""
    try:  # before the run, not after it
        require("psutil", sysmon.SAMPLING)
        if plots:
            require("matplotlib", report.PLOTTING)
    except MissingExtraError as exc:
        console.print(f"error: {exc}", style="red", markup=False, soft_wrap=True)  # [loadtest] is no markup
        raise typer.Exit(2) from None
    _store(db).close()  # a --db that is no results store is refused before the run, not after it
    targets = _targets(url, model or [], hardware, target or [], api_key, tokenizer or [])
    if unused := _unused(ctx):
        raise typer.BadParameter(unused, param_hint="options")
    if preset is Preset.paper:
        if conflicts := _paper_conflicts(ctx, output_len):
            raise typer.BadParameter(f"{', '.join(conflicts)} would change the paper's workload (1000 prompts x 512 "
                                     "tokens, one burst, fixed output); drop them or drop --preset",
                                     param_hint="--preset")
        requests, input_len, schedule = PAPER["requests"], PAPER["input_len"], PAPER["schedule"]
    if trace is not None:
        schedule = Schedule.trace
    try:
        workload = Workload(users * turns if users else requests, _length(input_len, "--input-len"),
                            _length(output_len, "--output-len"), dataset, prefix_len, num_prefixes,
                            paper=preset is Preset.paper, users=users, turns=turns,
                            system_prompt_len=system_prompt_len, question_len=question_len,
                            user_history_len=user_history_len, trace=trace,
                            trace_block_size=trace_block_size, time_scale=time_scale)
        if trace is not None and (sweep or capacity):
            workload.trace_rate()  # the rate a sweep or search scales the trace from
    except ValueError as exc:  # a trace that does not parse, or has no rate to scale
        raise typer.BadParameter(str(exc), param_hint="--trace") from None
    if workers > 1 and workload.chained:  # a request waiting for an answer must be in the process that gets it
        raise typer.BadParameter("deals independent requests to processes: conversations (--users) and a trace's "
                                 "sessions keep to one client process", param_hint="--workers")
    if ignore_eos is None:
        ignore_eos = dataset is None  # as vLLM: forced for random prompts only
    try:  # a sweep or search sets the rates (constant, or this poisson or gamma schedule; a trace's are its own)
        paced = (sweep or capacity) and schedule not in (Schedule.burst, Schedule.trace)
        check(schedule, 1.0 if paced else rate, burstiness)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--schedule / --rate / --burstiness") from None
    base = RunConfig(schedule=schedule, rate=rate, burstiness=burstiness, concurrency=concurrency, duration_s=duration,
                     think_time_s=think_time,
                     slos_ms=_slos(goodput or []), workers=workers, server_pid=server_pid,
                     request=RequestOptions(endpoint.value, temperature, ignore_eos, timeout))
    search = CapacitySearch(base.slos_ms, attainment, precision) if capacity else None
    session = Session(targets, workload, _sweep_points(base, sweep_concurrency, sweep_rate), warmup, seed, sweep,
                      search)
    try:
        results = _run(session)
    except (ValueError, BackendError) as exc:  # a workload the targets cannot take (lengths, templates, files)
        raise typer.BadParameter(str(exc), param_hint="--input-len / --dataset / --tokenizer") from None
    _save(results, out, db, plots)


def _targets(url, models, hardware, specs, api_key, tokenizers) -> list[Target]:
    if models and not url:
        raise typer.BadParameter("--model needs --url", param_hint="--model")
    if hardware and not url:
        raise typer.BadParameter("--hardware declares the --url server's; for --target use URL#MODEL@HARDWARE",
                                 param_hint="--hardware")
    targets = [Target(url, m, api_key, hardware=hardware) for m in models] if url else []
    try:
        targets += [Target.parse(t, api_key) for t in specs]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--target") from None
    if not targets:
        raise typer.BadParameter("give --url with --model, or --target URL#MODEL", param_hint="--target")
    if len(tokenizers) not in (0, 1, len(targets)):
        raise typer.BadParameter(f"give one --tokenizer for all targets or one per target ({len(targets)})",
                                 param_hint="--tokenizer")
    for i, t in enumerate(targets):
        t.tokenizer = tokenizers[i if len(tokenizers) > 1 else 0] if tokenizers else None
    return targets


def _sweep_points(base: RunConfig, sweep_concurrency: str | None, sweep_rate: str | None) -> list[RunConfig]:
    if sweep_concurrency and sweep_rate:
        raise typer.BadParameter("sweep one thing at a time", param_hint="--sweep-concurrency / --sweep-rate")
    if sweep_concurrency:
        return [replace(base, concurrency=c) for c in _numbers(sweep_concurrency, "--sweep-concurrency", int)]
    if sweep_rate:
        schedule = base.schedule if base.schedule is not Schedule.burst else Schedule.poisson
        return [replace(base, schedule=schedule, rate=r) for r in _numbers(sweep_rate, "--sweep-rate", float)]
    return [base]


def _run(session: Session) -> list[TargetResult]:
    # Drawn twice a second, and only on a terminal: rich's default redraws take CPU from a server sharing the
    # machine (docs/performance.md; vllm bench's tqdm draws per finished request).
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}"), console=console, refresh_per_second=2,
                  auto_refresh=console.is_terminal) as progress:

        def track(description: str, total: int):
            task = progress.add_task(description, total=total, status="")
            failed = 0

            def done(record) -> None:
                nonlocal failed
                failed += record is not None and not record.ok
                progress.update(task, advance=1, status=f"failed {failed}" if failed else "")

            return done

        return asyncio.run(run_session(session, track, lambda w: console.print(f"[yellow]warning: {w}")))


def _save(results: list[TargetResult], out: Path, db: Path | None, plots: bool) -> None:
    run_id = f"{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
    folder = out / run_id  # a new folder per run: nothing stale from an earlier run
    measured = [report.from_result(r) for r in results]
    for m in measured:
        for w in m.warnings:
            console.print(f"[yellow]warning ({m.name}): {w}")
    report.console_table([r.summary for r in results], console)
    path = db or store.default_db()
    with store.connect(path) as conn:
        ids = [store.save(conn, run_id, workload_key(r.summary, r.config), r.summary, result_to_json(r),
                          [rec.to_json() for rec in r.records]) for r in results]
        for search in {id(r.capacity): r.capacity for r in results if r.capacity is not None}.values():
            probes = [(i, r) for i, r in zip(ids, results) if r.capacity is search]
            first = probes[0][1]
            store.save_capacity(conn, run_id, capacity_key(first.summary, search),
                                first.summary, _deployments(first), search.to_json(), [i for i, _ in probes])
        recommendations = recommend([row for row in store.capacities(conn) if row["run_group"] == run_id])
    if recommendations:
        _print_recommendations(recommendations, f"capacity at SLO, run {run_id}")
    report.write_files(folder, results, measured, plots, recommendations)
    console.print(f"results: {folder}/ (report.html, summary.json, vllm/*.json); stored as run {run_id} in {path}")


def _deployments(result: TargetResult) -> list[dict]:
    """The target model's deployments as its server reports them (burstgate's GET /info), for the recommendation."""
    info = result.server_info or {}
    for group in info.get("models", []):
        if group.get("name") == result.target.model:
            return [{"kind": d.get("kind"), "settings": d.get("settings", {})} for d in group.get("deployments", [])]
    return []


def _print_recommendations(recommendations: list[Recommendation], title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    for col in ("hardware", "model", "workload", "SLO", "best (capacity, limited by)", "runner-up", "margin",
                "runs", "missing"):
        table.add_column(col)
    for r in recommendations:
        up = r.runner_up
        table.add_row(r.hardware, r.model, r.workload, describe_slos(r.slos),
                      f"{r.best.label} [{describe_settings(r.best.settings)}] {r.best.rate:.2f} {r.best.unit} "
                      f"({r.best.limited_by})",
                      f"{up.label} {up.rate:.2f} {up.unit}" if up else "- (no other target measured)",
                      f"{r.margin:+.0%}" if r.margin is not None else "-",
                      ", ".join(str(i) for i in r.best.run_ids + (up.run_ids if up else [])),
                      ", ".join(r.missing) or "-")
    console.print(table)


@app.command("report", cls=HelpCommand, epilog="""
burstgate loadtest report                       # the latest run
burstgate loadtest report 20261127-101500-ab12 --out report/
""")
def report_cmd(
    run_id: Annotated[str | None, typer.Argument(metavar="RUN_ID", help="Run id (default: the latest).", show_default=False)] = None,
    db: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, metavar="FILE",
                                            help="SQLite results store (default: the user's data dir).")] = None,
    out: Annotated[Path | None, typer.Option(metavar="DIR", help="Also write summary.json, plots and report.html "
                                                                 "here.")] = None,
) -> None:
    """Show a stored run again, and re-render its files."""
    with _store(db) as conn:
        groups = store.run_groups(conn)
        if not groups:
            raise typer.BadParameter("the store holds no runs", param_hint="--db")
        group = run_id or groups[-1]["run_group"]
        rows = store.load_group(conn, group)
        recommendations = recommend([row for row in store.capacities(conn) if row["run_group"] == group])
    if not rows:
        raise typer.BadParameter(f"no run {group!r}; stored runs: {', '.join(g['run_group'] for g in groups)}",
                                 param_hint="RUN_ID")
    console.print(f"run {group}: {rows[0]['summary'].get('workload')}")
    report.console_table([r["summary"] for r in rows], console)
    if recommendations:
        _print_recommendations(recommendations, f"capacity at SLO, run {group}")
    if out is not None:
        measured = [report.from_stored(r) for r in rows]
        out.mkdir(parents=True, exist_ok=True)
        report.write_summaries(out, [m.summary for m in measured])
        report.write_report(out, measured, f"burstgate load test {group}", recommendations)
        console.print(f"wrote {out}/report.html")


@app.command(cls=HelpCommand, short_help="One winner per server hardware, model and workload.", epilog="""
burstgate loadtest leaderboard --slo-ttft-ms 2000
""")
def leaderboard(
    db: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, metavar="FILE",
                                            help="SQLite results store (default: the user's data dir).")] = None,
    slo_ttft_ms: Annotated[float | None, typer.Option(metavar="MS", help="Only runs whose p99 TTFT meets this.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """One winner per (server hardware, model, workload), by throughput and by p99 TTFT; runs with failures never win."""
    from rich.table import Table

    with _store(db) as conn:
        board = store.leaderboard(conn, slo_ttft_ms)
    if json_out:
        print(json.dumps(board, indent=2))
        return
    table = Table(title="burstgate leaderboard")
    for col in ("hardware", "model", "workload", "runs (with failures)", "fastest by throughput", "output tok/s",
                "fastest by p99 TTFT", "p99 TTFT (ms)"):
        table.add_column(col)
    for row in board:
        table.add_row(row["hardware"], row["model"], row["workload"], f"{row['runs']} ({row['runs_with_failures']})",
                      row["fastest_by_throughput"] or "- (every run failed requests)",
                      f"{row['output_throughput']:.1f}" if row["output_throughput"] is not None else "-",
                      row["fastest_by_p99_ttft"] or "-",
                      f"{row['p99_ttft_ms']:.1f}" if row["p99_ttft_ms"] is not None else "-")
    console.print(table)


@app.command("recommend", cls=HelpCommand, short_help="The best target per hardware, model, workload and SLO.",
             epilog="""
burstgate loadtest recommend
burstgate loadtest recommend --run 20261127-101500-ab12 \\
    --run 20261127-103000-cd34 --json
""")
def recommend_cmd(
    run: Annotated[list[str] | None, typer.Option(metavar="RUN_ID", help="Rank only these runs' capacity searches "
                                                  "(refused when their workloads or SLOs differ); repeatable.")] = None,
    db: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, metavar="FILE",
                                            help="SQLite results store (default: the user's data dir).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Per (server hardware, model, workload, SLO): the target with the highest capacity at the SLO (from runs with
    --capacity), the runner-up and the margin, with their run ids; targets measured only under other workloads or
    SLOs are listed as missing."""
    with _store(db) as conn:
        rows = store.capacities(conn)
    if not rows:
        raise typer.BadParameter("the store holds no capacity searches: run `loadtest run --capacity --goodput ...` "
                                 "first", param_hint="--db")
    if run:
        try:
            rows = select(rows, run)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--run") from None
    recommendations = recommend(rows)
    if json_out:
        print(json.dumps([r.to_json() for r in recommendations], indent=2))
    else:
        _print_recommendations(recommendations, "burstgate recommendation: capacity at SLO")


def _store(db: Path | None):
    try:
        return store.connect(db)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--db") from None


@app.command("mock-server", cls=HelpCommand, short_help="An instant OpenAI-compatible server.", epilog="""
burstgate loadtest mock-server --port 8100 --ttft-ms 50 --itl-ms 10 \\
    --max-concurrency 64
""")
def mock_server(
    host: Annotated[str, typer.Option(metavar="ADDR", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="PORT", help="Port to listen on.")] = 8100,
    model: Annotated[str, typer.Option(metavar="NAME", help="Model name it answers to.")] = "mock",
    ttft_ms: Annotated[float, typer.Option(min=0, metavar="MS", help="Delay before the first token.")] = 0.0,
    itl_ms: Annotated[float, typer.Option(min=0, metavar="MS", help="Delay before every later token.")] = 0.0,
    max_concurrency: Annotated[int | None, typer.Option(min=1, metavar="N", help="Serve at most N requests at "
                                                        "once, queueing the rest (a known capacity).")] = None,
) -> None:
    """An instant OpenAI-compatible server, to measure the tester's or a gateway's own overhead."""
    import uvicorn

    from loadtest.mock_server import create_mock_app

    uvicorn.run(create_mock_app(model, ttft_ms / 1000, itl_ms / 1000, max_concurrency=max_concurrency), host=host,
                port=port, log_level="warning")
