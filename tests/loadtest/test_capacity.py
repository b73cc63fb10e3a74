"""Capacity at an SLO and guidellm's sweep: the search's arithmetic on a target whose capacity is known by
construction, then a real search against a mock server of known capacity over HTTP."""

from __future__ import annotations

import asyncio
import json

import pytest

from loadtest.capacity import search, sweep, sweep_rates
from loadtest.client import RequestOptions, Target
from loadtest.metrics import RequestRecord
from loadtest.mock_server import create_mock_app
from loadtest.runner import RunConfig, TargetResult
from loadtest.schedule import Schedule
from loadtest.session import CapacitySearch, Session, Workload, run_session
from tests.servers import serve_app

BASE = RunConfig(request=RequestOptions(ignore_eos=True))


def _target_with_capacity(capacity: float, sync_rate: float, seen: list[RunConfig]):
    """A measurement of a target that meets a 100 ms TTFT SLO on every request up to ``capacity`` requests/s and
    on none above it; one at a time it completes ``sync_rate`` requests/s, all at once (late) 1.5 x ``capacity``."""

    async def measure(cfg: RunConfig, role: str) -> TargetResult:
        seen.append(cfg)
        rate = cfg.rate if cfg.rate is not None else (sync_rate if cfg.concurrency == 1 else 1.5 * capacity)
        ttft = 0.05 if cfg.concurrency == 1 or (cfg.rate is not None and cfg.rate <= capacity) else 0.5
        records = [RequestRecord(i, 0.0, actual_send=0.0, chunk_times=[ttft], ok=True) for i in range(10)]
        return TargetResult(Target("http://x", "m"), cfg, records, {"request_throughput": rate})

    return measure


def test_sweep_rates_are_guidellms_evenly_between_synchronous_and_throughput():
    assert sweep_rates(2.0, 10.0, 4) == [4.0, 6.0, 8.0, 10.0]


def test_a_sweep_measures_synchronous_throughput_then_constant_rates():
    seen: list[RunConfig] = []
    asyncio.run(sweep(_target_with_capacity(30.0, 5.0, seen), BASE, 5))
    assert [c.concurrency for c in seen[:2]] == [1, None] and seen[1].schedule is Schedule.burst
    assert [c.rate for c in seen[2:]] == [13.0, 21.0, 29.0, 37.0, 45.0]  # 5 .. 1.5 x 30
    assert {c.schedule for c in seen[2:]} == {Schedule.constant}


@pytest.mark.parametrize("capacity", [7.3, 12.0, 19.9])
def test_the_search_finds_a_known_capacity_within_its_precision(capacity):
    seen: list[RunConfig] = []
    measure = _target_with_capacity(capacity, 2.0, seen)
    results, found = asyncio.run(search(measure, BASE, {"ttft": 100}, precision=0.02))
    assert found.limited_by == "slo" and capacity * 0.98 <= found.rate <= capacity
    assert len(results) == len(found.probes) == len(seen)
    assert [p["passed"] for p in found.probes[:3]] == [True, False, False]  # synchronous, throughput, its rate
    # the first failing rate above the answer is within the precision
    failing = min(p["rate"] for p in found.probes if not p["passed"] and p["rate"])
    assert failing <= found.rate / (1 - 0.02)


def test_a_target_missing_the_slo_one_request_at_a_time_has_no_capacity():
    async def slow(cfg, role):
        records = [RequestRecord(0, 0.0, actual_send=0.0, chunk_times=[1.0], ok=True)]
        return TargetResult(Target("http://x", "m"), cfg, records, {"request_throughput": 1.0})

    results, found = asyncio.run(search(slow, BASE, {"ttft": 100}))
    assert (found.rate, found.limited_by, len(results)) == (0.0, "latency floor", 1)


def test_failed_requests_count_as_misses():
    async def failing(cfg, role):
        records = [RequestRecord(i, 0.0, actual_send=0.0, chunk_times=[0.01], ok=i > 0) for i in range(10)]
        return TargetResult(Target("http://x", "m"), cfg, records, {"request_throughput": 1.0})

    _, found = asyncio.run(search(failing, BASE, {"ttft": 100}, attainment=0.95))
    assert found.probes[0]["attained"] == 0.9 and found.rate == 0.0


def test_a_search_needs_an_slo():
    with pytest.raises(ValueError, match="--goodput"):
        asyncio.run(search(_target_with_capacity(1, 1, []), BASE, {}))


def test_the_capacity_of_a_server_of_known_capacity_is_found_over_http():
    # 2 slots x 0.1 s per request (50 ms to the first token, 2 more 25 ms apart): 20 requests/s, where a queue
    # starts to grow; below it the 90 ms TTFT SLO holds, so the capacity is the server's own limit
    workload = Workload(30, 16, 3)
    search_for = CapacitySearch({"ttft": 90}, attainment=0.9, precision=0.1)
    with serve_app(create_mock_app("m", ttft_s=0.05, itl_s=0.025, max_concurrency=2)) as url:
        session = Session([Target(url, "m")], workload, [BASE], warmup=0, seed=0, capacity=search_for)
        results = asyncio.run(run_session(session))
    found = results[0].capacity
    assert all(r.capacity is found for r in results) and len(results) == len(found.probes)
    assert 20 * 0.8 <= found.rate <= 20 * 1.1 and found.limited_by in ("throughput", "slo"), found.probes
    assert [r.summary["point_role"] for r in results[:2]] == ["synchronous", "throughput"]


def test_duration_bounds_each_paced_probe_of_a_search_from_the_command_line(tmp_path):
    # one request at a time and the constant rates stop sending after --duration; the burst sends everything at t=0
    from typer.testing import CliRunner

    from gateway.cli import app as cli

    with serve_app(create_mock_app("m", ttft_s=0.05, itl_s=0.025, max_concurrency=2)) as url:
        result = CliRunner().invoke(cli, [
            "loadtest", "run", "--target", f"{url}#m", "--requests", "120", "--input-len", "16", "--output-len", "3",
            "--capacity", "--goodput", "ttft:90", "--precision", "0.2", "--duration", "0.5", "--warmup", "0",
            "--out", str(tmp_path / "runs"), "--db", str(tmp_path / "store.sqlite"), "--no-plots"])
    assert result.exit_code == 0, result.output
    (summary,) = (tmp_path / "runs").glob("*/summary.json")
    points = json.loads(summary.read_text())
    roles = [p["point_role"] for p in points]
    assert roles[:2] == ["synchronous", "throughput"] and len(roles) > 2, roles
    for p in points:
        sent = p["completed"] + p["failed"]
        assert sent == 120 if p["point_role"] == "throughput" else 0 < sent < 60, p


def test_the_capacity_of_a_trace_is_its_highest_rate_meeting_the_slo_time_scaled(tmp_path):
    # a trace of 30 requests 0.5 s apart (2 req/s at its own times) against the server of the test above
    # (capacity 20 req/s): each probe replays the trace with its times scaled to the probe's rate
    from loadtest.schedule import Schedule

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 500 * i, "input_length": 16, "output_length": 3}) + "\n"
                             for i in range(30)))
    workload = Workload(0, 1, 1, trace=trace)
    base = RunConfig(schedule=Schedule.trace, request=RequestOptions(ignore_eos=True))
    search_for = CapacitySearch({"ttft": 90}, attainment=0.9, precision=0.1)
    with serve_app(create_mock_app("m", ttft_s=0.05, itl_s=0.025, max_concurrency=2)) as url:
        session = Session([Target(url, "m")], workload, [base], warmup=0, seed=0, capacity=search_for)
        results = asyncio.run(run_session(session))
    found = results[0].capacity
    assert found.arrivals == "trace, time-scaled" and found.limited_by in ("throughput", "slo"), found.probes
    assert 20 * 0.8 <= found.rate <= 20 * 1.1, found.probes
    for result in results[2:]:  # the rate probes: the trace's 0.5 s gaps scaled so that, as a constant schedule
        # at the probe's rate, its 30 requests take 30 / rate (the first at 0 here, one gap in there)
        sends = sorted(r.target_send for r in result.records)
        assert sends[-1] - sends[0] == pytest.approx(30 / result.config.rate, rel=0.02)
        assert sends[1] - sends[0] == pytest.approx((sends[-1] - sends[0]) / 29, rel=0.05)
        assert result.summary["completed"] == 30


def _trace_file(tmp_path, times_ms: list[int]):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 8, "output_length": 2}) + "\n"
                             for t in times_ms))
    return trace


@pytest.mark.parametrize("times_ms, extra, named", [
    ([0, 100], ["--time-scale", "0.5"], "--time-scale"),  # the search scales the trace itself
    ([0, 0], [], "no rate to scale"),  # every request due at once: nothing to scale from
])
def test_a_search_over_a_trace_refuses_what_it_cannot_scale(tmp_path, times_ms, extra, named):
    from typer.testing import CliRunner

    from gateway.cli import app as cli

    result = CliRunner().invoke(cli, ["loadtest", "run", "--target", "http://127.0.0.1:9#m", "--trace",
                                      str(_trace_file(tmp_path, times_ms)), "--capacity", "--goodput", "ttft:90",
                                      *extra], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and named in result.output, result.output


def test_a_search_over_a_trace_runs_from_the_command_line(tmp_path):
    from typer.testing import CliRunner

    from gateway.cli import app as cli

    with serve_app(create_mock_app("m", ttft_s=0.01, itl_s=0.005)) as url:
        result = CliRunner().invoke(cli, [
            "loadtest", "run", "--target", f"{url}#m", "--trace", str(_trace_file(tmp_path, [0, 100, 200, 300])),
            "--capacity", "--goodput", "ttft:500", "--precision", "0.3", "--warmup", "0", "--out", str(tmp_path / "runs"),
            "--db", str(tmp_path / "store.sqlite"), "--no-plots"])
    assert result.exit_code == 0, result.output
    (summary,) = (tmp_path / "runs").glob("*/summary.json")
    points = json.loads(summary.read_text())
    assert [p["point_role"] for p in points[:3]] == ["synchronous", "throughput", "probe"]
    assert all(p["completed"] == 4 for p in points) and "schedule=trace rate=" in points[2]["point"]


def test_the_capacity_over_conversations_is_in_conversations_per_second():
    # the server of the tests above (20 requests/s): a conversation of 2 turns without think time takes 2 of its
    # requests, so it carries 10 conversations/s; one conversation at a time has one request in flight
    workload = Workload(40, 16, 3, users=20, turns=2, question_len=16)
    chat = RunConfig(request=RequestOptions(endpoint="chat", ignore_eos=True))
    search_for = CapacitySearch({"ttft": 90}, attainment=0.9, precision=0.1)
    with serve_app(create_mock_app("m", ttft_s=0.05, itl_s=0.025, max_concurrency=2)) as url:
        session = Session([Target(url, "m")], workload, [chat], warmup=0, seed=0, capacity=search_for)
        results = asyncio.run(run_session(session))
    found = results[0].capacity
    assert found.unit == "conversations/s" and 10 * 0.8 <= found.rate <= 10 * 1.1, found.probes
    synchronous = results[0].summary
    assert synchronous["point_role"] == "synchronous" and synchronous["max_concurrent_requests"] == 1
    assert synchronous["completed_conversations"] == synchronous["conversations"] == 20
    assert all(p["throughput"] == r.summary["conversation_throughput"] for p, r in zip(found.probes, results))


def test_a_sweep_over_conversations_runs_from_the_command_line(tmp_path):
    from typer.testing import CliRunner

    from gateway.cli import app as cli

    with serve_app(create_mock_app("m", ttft_s=0.01, itl_s=0.005)) as url:
        result = CliRunner().invoke(cli, [
            "loadtest", "run", "--target", f"{url}#m", "--endpoint", "chat", "--users", "4", "--turns", "2",
            "--question-len", "8", "--output-len", "2", "--sweep", "1", "--warmup", "0", "--out", str(tmp_path / "runs"),
            "--db", str(tmp_path / "store.sqlite"), "--no-plots"])
    assert result.exit_code == 0, result.output
    (summary,) = (tmp_path / "runs").glob("*/summary.json")
    points = json.loads(summary.read_text())
    assert [p["point_role"] for p in points] == ["synchronous", "throughput", "constant"]
    assert all(p["completed_conversations"] == 4 and p["completed"] == 8 for p in points)
    # the constant point's rate is of conversations: between one at a time and all at once
    assert points[0]["conversation_throughput"] < points[2]["request_rate"] <= points[1]["conversation_throughput"]
