"""``burstgate loadtest run | report | leaderboard | mock-server``."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest import report, store, sysmon
from loadtest.client import RequestOptions, Target
from loadtest.extras import MissingExtraError, require
from loadtest.runner import RunConfig, TargetResult, result_to_json, run_target
from loadtest.schedule import Schedule
from loadtest.workload import RequestSpec, from_file, load_tokenizer, synthetic

app = typer.Typer(no_args_is_help=True, add_completion=False)
console = Console()


def _parse_range(text: str, name: str) -> int | tuple[int, int]:
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


def _parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise typer.BadParameter(f"{item!r}: use ttft:MS, tpot:MS or e2el:MS", param_hint="--goodput")
        slos[key] = float(value)
    return slos


def _workload(dataset: Path | None, tokenizer_name: str | None, requests: int, input_len: str, output_len: str,
              prefix_len: int, num_prefixes: int, seed: int) -> tuple[list[RequestSpec], str]:
    tokenizer = load_tokenizer(tokenizer_name)
    tok_name = Path(tokenizer_name).name if tokenizer_name else "SmolLM2-135M-Instruct"
    out = _parse_range(output_len, "--output-len")
    if dataset is not None:
        specs = from_file(dataset, tokenizer, requests, out if isinstance(out, int) else None, seed)
        return specs, f"dataset={dataset.name} n={len(specs)} out={output_len} tokenizer={tok_name}"
    specs = synthetic(tokenizer, requests, _parse_range(input_len, "--input-len"), out, seed, prefix_len, num_prefixes)
    desc = f"synthetic in={input_len} out={output_len} n={requests} tokenizer={tok_name}"
    if prefix_len:
        desc += f" prefix={prefix_len}x{num_prefixes}"
    return specs, desc


@app.command()
def run(
    url: Annotated[str | None, typer.Option(help="Base URL shared by every --model.")] = None,
    model: Annotated[list[str], typer.Option(help="Model name at --url; repeat to compare several.")] = [],
    target: Annotated[list[str], typer.Option(help="Another target as URL#MODEL; repeatable.")] = [],
    api_key: Annotated[str | None, typer.Option(envvar="BURSTGATE_LOADTEST_API_KEY", help="Bearer key.")] = None,
    requests: Annotated[int, typer.Option(min=1, help="Requests per target (per sweep point).")] = 100,
    input_len: Annotated[str, typer.Option(help="Prompt tokens: N or LOW:HIGH.")] = "512",
    output_len: Annotated[str, typer.Option(help="max_tokens: N or LOW:HIGH.")] = "128",
    preset: Annotated[str | None, typer.Option(help="'paper': 1000 prompts x 512 tokens, burst (arXiv 2311.03687).")] = None,
    dataset: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="JSONL, ShareGPT or Alpaca JSON.")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="Local tokenizer dir or .gguf (default: embedded SmolLM2).")] = None,
    prefix_len: Annotated[int, typer.Option(min=0, help="Shared prefix tokens (prefix-caching workloads).")] = 0,
    num_prefixes: Annotated[int, typer.Option(min=1, help="Distinct shared prefixes.")] = 1,
    schedule: Annotated[Schedule, typer.Option(help="Arrival schedule.")] = Schedule.burst,
    rate: Annotated[float | None, typer.Option(help="Requests/s for poisson, gamma and constant.")] = None,
    burstiness: Annotated[float, typer.Option(help="Gamma shape (1 = Poisson).")] = 1.0,
    concurrency: Annotated[int | None, typer.Option(min=1, help="Closed loop: at most N in flight.")] = None,
    sweep_concurrency: Annotated[str | None, typer.Option(help="Comma list of concurrencies to sweep.")] = None,
    sweep_rate: Annotated[str | None, typer.Option(help="Comma list of rates to sweep.")] = None,
    duration: Annotated[float | None, typer.Option(help="Stop sending after this many seconds.")] = None,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed requests before each run.")] = 0,
    endpoint: Annotated[str, typer.Option(help="completions or chat.")] = "completions",
    temperature: Annotated[float, typer.Option()] = 0.0,
    ignore_eos: Annotated[bool, typer.Option(help="Generate exactly max_tokens (vLLM extension).")] = True,
    timeout: Annotated[float, typer.Option(help="Per-request timeout (s).")] = 600.0,
    goodput: Annotated[list[str], typer.Option(help="SLO for goodput, e.g. ttft:500 (ms); repeatable.")] = [],
    workers: Annotated[int, typer.Option(min=1, help="Client processes (when one cannot keep up).")] = 1,
    server_pid: Annotated[int | None, typer.Option(help="Sample this local server process's CPU/RSS.")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("results/latest"),
    db: Annotated[Path, typer.Option(help="SQLite results store.")] = store.DEFAULT_DB,
    plots: Annotated[bool, typer.Option(help="Write PNG plots.")] = True,
) -> None:
    """Run the same workload against every target, one after another, and compare them."""
    try:  # before the run, not after it
        require("psutil", sysmon.SAMPLING)
        if plots:
            require("matplotlib", report.PLOTTING)
    except MissingExtraError as exc:
        console.print(f"error: {exc}", style="red", markup=False, soft_wrap=True)  # [loadtest] is no markup
        raise typer.Exit(2) from None
    targets = [Target(url, m, api_key) for m in model] if url else []
    if model and not url:
        raise typer.BadParameter("--model needs --url", param_hint="--model")
    try:
        targets += [Target.parse(t, api_key) for t in target]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--target") from None
    if not targets:
        raise typer.BadParameter("give --url with --model, or --target URL#MODEL", param_hint="--model")
    if endpoint not in ("completions", "chat"):
        raise typer.BadParameter("completions or chat", param_hint="--endpoint")
    if preset == "paper":
        requests, input_len, schedule = 1000, "512", Schedule.burst
    elif preset is not None:
        raise typer.BadParameter("the only preset is 'paper'", param_hint="--preset")
    try:
        specs, workload = _workload(dataset, tokenizer, requests, input_len, output_len, prefix_len, num_prefixes, seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--dataset / --input-len / --prefix-len") from None
    base = RunConfig(schedule=schedule, rate=rate, burstiness=burstiness, concurrency=concurrency,
                     duration_s=duration, warmup=warmup, seed=seed, slos_ms=_parse_slos(goodput), workers=workers,
                     server_pid=server_pid, request=RequestOptions(endpoint, temperature, ignore_eos, timeout))
    points = _sweep_points(base, sweep_concurrency, sweep_rate)
    results = asyncio.run(_run_all(targets, specs, points))
    summaries = [r.summary for r in results]
    for r in results:
        for w in r.warnings:
            console.print(f"[yellow]warning ({r.summary['label']}): {w}")
    report.console_table(summaries, console)
    report.write_files(out, results)
    group = uuid.uuid4().hex[:12]
    with store.connect(db) as conn:
        for r in results:
            store.save(conn, group, workload + _point_desc(r.config), r.summary, result_to_json(r))
    if plots:
        _plot(out, results)
    console.print(f"results: {out}/summary.json  (stored as run {group} in {db})")


def _sweep_points(base: RunConfig, sweep_concurrency: str | None, sweep_rate: str | None) -> list[RunConfig]:
    from dataclasses import replace

    if sweep_concurrency:
        return [replace(base, concurrency=int(c)) for c in sweep_concurrency.split(",")]
    if sweep_rate:
        schedule = base.schedule if base.schedule is not Schedule.burst else Schedule.poisson
        return [replace(base, schedule=schedule, rate=float(r)) for r in sweep_rate.split(",")]
    return [base]


def _point_desc(cfg: RunConfig) -> str:
    desc = f" schedule={cfg.schedule.value}"
    if cfg.rate:
        desc += f" rate={cfg.rate:g}"
    if cfg.concurrency:
        desc += f" concurrency={cfg.concurrency}"
    return desc


async def _run_all(targets: list[Target], specs: list[RequestSpec], points: list[RunConfig]) -> list[TargetResult]:
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}"), console=console) as progress:
        for t in targets:
            for cfg in points:
                task = progress.add_task(f"{t.label}{_point_desc(cfg)}", total=len(specs), status="")
                failed = 0

                def done(record, task=task):
                    nonlocal failed
                    failed += record is not None and not record.ok
                    progress.update(task, advance=1, status=f"failed {failed}" if failed else "")

                results.append(await run_target(t, specs, cfg, done))
    return results


def _plot(out: Path, results: list[TargetResult]) -> None:
    labels = [r.summary["label"] + _point_desc(r.config) for r in results]
    report.plot(out, labels, [[rec.to_json() for rec in r.records] for r in results], [r.summary for r in results],
                [[s.__dict__ for s in r.samples] for r in results])


@app.command("report")
def report_cmd(
    run_group: Annotated[str | None, typer.Argument(help="Run id (default: the latest).")] = None,
    db: Annotated[Path, typer.Option(exists=True, dir_okay=False)] = store.DEFAULT_DB,
    out: Annotated[Path | None, typer.Option(help="Also re-write summary.json and plots here.")] = None,
) -> None:
    """Re-render a stored run."""
    with store.connect(db) as conn:
        groups = store.run_groups(conn)
        if not groups:
            raise typer.BadParameter("the store holds no runs", param_hint="--db")
        group = run_group or groups[-1]["run_group"]
        rows = store.load_group(conn, group)
    if not rows:
        raise typer.BadParameter(f"no run {group!r}; stored runs: {', '.join(g['run_group'] for g in groups)}")
    console.print(f"run {group} on {rows[0]['hardware']}: {rows[0]['workload']}")
    summaries = [r["summary"] for r in rows]
    report.console_table(summaries, console)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summaries, indent=2))


@app.command()
def leaderboard(
    db: Annotated[Path, typer.Option(exists=True, dir_okay=False)] = store.DEFAULT_DB,
    slo_ttft_ms: Annotated[float | None, typer.Option(help="Only runs whose p99 TTFT meets this.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Fastest target per hardware and workload, by throughput and by p99 TTFT."""
    from rich.table import Table

    with store.connect(db) as conn:
        board = store.leaderboard(conn, slo_ttft_ms)
    if json_out:
        print(json.dumps(board, indent=2))
        return
    table = Table(title="burstgate leaderboard")
    for col in ("hardware", "workload", "runs", "fastest by throughput", "output tok/s", "fastest by p99 TTFT",
                "p99 TTFT (ms)"):
        table.add_column(col)
    for row in board:
        table.add_row(row["hardware"], row["workload"], str(row["runs"]), row["fastest_by_throughput"],
                      f"{row['output_throughput']:.1f}", row["fastest_by_p99_ttft"] or "-",
                      f"{row['p99_ttft_ms']:.1f}" if row["p99_ttft_ms"] is not None else "-")
    console.print(table)


@app.command("mock-server")
def mock_server(
    host: str = "127.0.0.1", port: int = 8100, model: str = "mock",
    ttft_ms: Annotated[float, typer.Option(min=0)] = 0.0, itl_ms: Annotated[float, typer.Option(min=0)] = 0.0,
) -> None:
    """An instant OpenAI-compatible server, to measure the tester's or a gateway's own overhead."""
    import uvicorn

    from loadtest.mock_server import create_mock_app

    uvicorn.run(create_mock_app(model, ttft_ms / 1000, itl_ms / 1000), host=host, port=port, log_level="warning")
