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
from gateway.info import describe, devices
from loadtest.client import RequestOptions, Target
from loadtest.mock_server import create_mock_app
from loadtest.runner import RunConfig, run_target
from loadtest.schedule import Schedule
from loadtest.workload import load_tokenizer, synthetic
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


def test_burst_of_100_with_exact_prompt_counts_stored_and_re_rendered(gateway, mock, tmp_path, engine_idle):
    runs, db = tmp_path / "runs", tmp_path / "store.sqlite"
    args = ["loadtest", "run", "--target", f"{gateway}#{MODEL}", "--target", f"{mock}#mock@instant mock",
            "--requests", "100", "--input-len", "12:40", "--output-len", "4", "--out", str(runs), "--db", str(db)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    (folder,) = runs.iterdir()  # each run writes its own folder
    summaries = json.loads((folder / "summary.json").read_text())
    assert [s["model_id"] for s in summaries] == [MODEL, "mock"]
    native = summaries[0]
    assert native["completed"] == 100 and native["failed"] == 0 and native["total_output_tokens"] == 400
    assert native["hardware"] == describe(devices()) and summaries[1]["hardware"] == "instant mock"
    assert native["warmup_requests"] == 4 and native["prompts"].startswith("fresh for this run")  # the defaults
    assert native["request_goodput"] is None and "model" not in native
    for key in ("tokenizer_id", "date", "backend", "max_output_tokens_per_s", "mean_client_queue_time_ms",
                "median_tpot_ms", "std_itl_ms", "p99_e2el_ms"):
        assert key in native
    # usage.prompt_tokens from the server equals what the workload planned, request by request
    records = [json.loads(line) for line in (folder / "requests-0.jsonl").read_text().splitlines()]
    assert all(r["prompt_tokens"] == r["planned_prompt_tokens"] for r in records)
    assert {r["prompt_tokens"] for r in records} <= set(range(12, 41)) and native["prompt_tokens_mismatched"] == 0
    vllm_files = sorted((folder / "vllm").iterdir())
    assert len(vllm_files) == 2 and json.loads(vllm_files[0].read_text())["model_id"] == MODEL
    assert {p.name for p in folder.glob("*.png")} >= {"latency_cdf.png", "latency_box.png", "throughput.png",
                                                      "throughput_over_time.png", "ttft_over_time.png",
                                                      "itl_distribution.png"}
    html = (folder / "report.html").read_text()
    assert html.count("src='data:image/png;base64,") >= 6 and "src='http" not in html  # self-contained

    again = CliRunner().invoke(cli, args[:-6] + ["--requests", "3", "--input-len", "8", "--out", str(runs),
                                                 "--db", str(db), "--no-plots"])
    assert again.exit_code == 0, again.output
    assert len(list(runs.iterdir())) == 2 and len(json.loads((folder / "summary.json").read_text())) == 2

    report = CliRunner().invoke(cli, ["loadtest", "report", "--db", str(db), "--out", str(tmp_path / "re")])
    assert report.exit_code == 0 and MODEL in report.output
    assert (tmp_path / "re" / "report.html").exists() and (tmp_path / "re" / "latency_box.png").exists()
    board = CliRunner().invoke(cli, ["loadtest", "leaderboard", "--db", str(db), "--json"])
    assert board.exit_code == 0
    rows = json.loads(board.output)  # two runs each of two models on two kinds of hardware, two workloads
    assert len(rows) == 4 and all(r["runs"] == 1 and r["fastest_by_throughput"] for r in rows)


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
    return load_tokenizer(None)


def _broken(mode: str) -> Starlette:
    async def handler(request):
        if mode == "500":
            return JSONResponse({"error": "down"}, status_code=500)

        async def body():
            if mode == "malformed":
                yield b"data: {oops\n\n"
            elif mode == "not an object":
                yield b"data: [1, 2]\n\n"
            elif mode == "truncated":
                yield b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
            elif mode == "stall":
                yield b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
                await asyncio.sleep(60)
        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", handler, methods=["POST"])])


@pytest.mark.parametrize("mode, kind", [("500", "http_500"), ("malformed", "malformed"), ("not an object", "malformed"),
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
