"""The load tester against real servers on 127.0.0.1: burstgate on the embedded model, the instant mock
server, and broken targets. Runs go through the CLI, are stored, and reappear in report/leaderboard."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from typer.testing import CliRunner

from gateway.cli import app as cli
from loadtest.client import RequestOptions, Target
from loadtest.mock_server import create_mock_app
from loadtest.runner import RunConfig, run_target
from loadtest.schedule import Schedule
from loadtest.workload import synthetic
from tests.conftest import MODEL
from tests.servers import free_port, serve_app


@pytest.fixture(scope="module")
def gateway(start_gateway):
    with start_gateway() as (url, _):
        yield url


@pytest.fixture(scope="module")
def mock():
    with serve_app(create_mock_app("mock")) as url:
        yield url


def test_burst_of_200_with_exact_prompt_counts_and_stored_results(gateway, mock, tmp_path, engine_idle):
    out, db = tmp_path / "run", tmp_path / "store.sqlite"
    result = CliRunner().invoke(cli, [
        "loadtest", "run", "--target", f"{gateway}#{MODEL}", "--target", f"{mock}#mock",
        "--requests", "200", "--input-len", "12:40", "--output-len", "4", "--out", str(out), "--db", str(db)])
    assert result.exit_code == 0, result.output
    summaries = json.loads((out / "summary.json").read_text())
    assert [s["model"] for s in summaries] == [MODEL, "mock"]
    native = summaries[0]
    assert native["completed"] == 200 and native["failed"] == 0 and native["total_output_tokens"] == 800
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_tpot_ms", "std_itl_ms", "p99_e2el_ms"):
        assert key in native
    # usage.prompt_tokens from the server equals what the workload built, request by request
    records = [json.loads(line) for line in (out / "requests-0.jsonl").read_text().splitlines()]
    workload = {i: s.prompt_tokens for i, s in enumerate(_workload())}
    assert all(r["prompt_tokens"] == workload[r["index"]] for r in records)
    assert {p.name for p in out.glob("*.png")} >= {"latency_cdf.png", "latency_box.png", "throughput.png"}

    report = CliRunner().invoke(cli, ["loadtest", "report", "--db", str(db)])
    assert report.exit_code == 0 and MODEL in report.output and "mock" in report.output
    board = CliRunner().invoke(cli, ["loadtest", "leaderboard", "--db", str(db), "--json"])
    assert board.exit_code == 0
    (row,) = json.loads(board.output)
    assert row["runs"] == 2 and row["fastest_by_throughput"].startswith("mock@")  # the instant server wins


def _workload():
    from backends.native.weights import default_model_path
    from backends.tokenizer import Tokenizer

    return synthetic(Tokenizer(default_model_path()), 200, (12, 40), 4, seed=0)


def test_closed_loop_concurrency_is_respected(mock):
    specs = synthetic(_tok(), 40, 8, 3)
    result = asyncio.run(run_target(Target(mock, "mock"), specs, RunConfig(concurrency=4)))
    assert result.summary["completed"] == 40 and result.summary["max_concurrent_requests"] <= 4


def test_a_paced_schedule_sends_each_request_at_its_time_never_early_and_in_order(mock):
    specs = synthetic(_tok(), 30, 8, 2)
    result = asyncio.run(run_target(Target(mock, "mock"), specs, RunConfig(schedule=Schedule.poisson, rate=300,
                                                                           seed=3)))
    records = sorted(result.records, key=lambda r: r.target_send)
    assert len(records) == 30 and len({r.target_send for r in records}) == 30  # a real schedule, not a burst
    assert all(r.actual_send >= r.target_send for r in records)
    sends = [r.actual_send for r in records]
    assert sends == sorted(sends)


def test_a_duration_bound_stops_sending_at_the_deadline(mock):
    specs = synthetic(_tok(), 200, 8, 2)
    result = asyncio.run(run_target(Target(mock, "mock"), specs, RunConfig(schedule=Schedule.constant, rate=100,
                                                                           duration_s=0.5)))
    assert result.summary["completed"] in (50, 51)  # sends due after 0.5 s of a 2 s schedule are never made


def test_several_worker_processes(mock):
    specs = synthetic(_tok(), 60, 8, 3)
    result = asyncio.run(run_target(Target(mock, "mock"), specs, RunConfig(workers=2)))
    assert result.summary["completed"] == 60 and sorted(r.index for r in result.records) == list(range(60))


def _tok():
    from backends.native.weights import default_model_path
    from backends.tokenizer import Tokenizer

    return Tokenizer(default_model_path())


def _broken(mode: str) -> Starlette:
    async def handler(request):
        if mode == "500":
            return JSONResponse({"error": "down"}, status_code=500)

        async def body():
            if mode == "malformed":
                yield b"data: {oops\n\n"
            elif mode == "truncated":
                yield b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
            elif mode == "stall":
                yield b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
                await asyncio.sleep(60)
        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", handler, methods=["POST"])])


@pytest.mark.parametrize("mode, kind", [("500", "http_500"), ("malformed", "malformed"),
                                        ("truncated", "incomplete"), ("stall", "timeout")])
def test_bad_targets_are_reported_per_request_and_never_hang(mode, kind):
    specs = synthetic(_tok(), 5, 8, 3)
    cfg = RunConfig(request=RequestOptions(stall_timeout_s=1.0, timeout_s=5.0))
    with serve_app(_broken(mode)) as url:
        result = asyncio.run(asyncio.wait_for(run_target(Target(url, "x"), specs, cfg), 30))
    assert result.summary["failed"] == 5 and result.summary["failures_by_kind"] == {kind: 5}
    assert all(r.error for r in result.records)


def test_connection_refused():
    specs = synthetic(_tok(), 3, 8, 3)
    result = asyncio.run(run_target(Target(f"http://127.0.0.1:{free_port()}", "x"), specs, RunConfig()))
    assert result.summary["failures_by_kind"] == {"connection": 3}


def test_cli_refuses_bad_options():
    runner = CliRunner()
    assert runner.invoke(cli, ["loadtest", "run", "--requests", "1"]).exit_code != 0  # no target
    assert runner.invoke(cli, ["loadtest", "run", "--target", "nohash", "--requests", "1"]).exit_code != 0
    bad_len = runner.invoke(cli, ["loadtest", "run", "--target", "http://x#m", "--input-len", "9:3"])
    assert bad_len.exit_code != 0 and "LOW:HIGH" in bad_len.output
