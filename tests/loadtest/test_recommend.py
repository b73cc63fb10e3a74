"""``loadtest recommend``: from stored capacity searches, the winner per (hardware, model, workload, SLO) with the
runner-up and margin; runs of other workloads or SLOs are never ranked together, and what is missing is said.
The last test goes through the command line: two mock servers of known capacities, searched, stored, ranked."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gateway.cli import app as cli
from loadtest import store
from loadtest.mock_server import create_mock_app
from loadtest.recommend import recommend, select
from tests.servers import serve_app

TIGHT = {"ttft": 500.0}


def _store_capacity(db, label, rate, hardware="H100", workload="chat in=512 out=128", slos=TIGHT, run="run-1"):
    summary = {"hardware": hardware, "model_id": "llama", "url": f"http://{label}", "label": label}
    capacity = {"slos_ms": slos, "attainment": 0.9, "rate": rate, "limited_by": "slo", "precision": 0.05,
                "probes": []}
    store.save_capacity(db, run, workload, summary, [{"kind": label, "settings": {}}], capacity, [rate * 10])


@pytest.fixture
def db(tmp_path):
    with store.connect(tmp_path / "store.sqlite") as conn:
        yield conn


def test_the_highest_capacity_wins_with_its_runner_up_and_margin(db):
    _store_capacity(db, "vllm", 8.0)
    _store_capacity(db, "native", 10.0)
    _store_capacity(db, "tgi", 4.0)
    (r,) = recommend(store.capacities(db))
    assert (r.best.label, r.runner_up.label, r.margin) == ("native", "vllm", pytest.approx(0.25))
    assert r.best.run_ids == [100.0] and r.best.settings == [{"kind": "native", "settings": {}}]


def test_workloads_slos_and_hardware_are_ranked_apart_and_missing_targets_named(db):
    _store_capacity(db, "vllm", 8.0)
    _store_capacity(db, "native", 10.0)
    _store_capacity(db, "vllm", 9.0, slos={"ttft": 1000.0})  # another SLO: its own group
    _store_capacity(db, "native", 3.0, hardware="A800")
    groups = {(r.hardware, json.dumps(r.slos["slos_ms"])): r for r in recommend(store.capacities(db))}
    assert set(groups) == {("H100", '{"ttft": 500.0}'), ("H100", '{"ttft": 1000.0}'), ("A800", '{"ttft": 500.0}')}
    loose = groups[("H100", '{"ttft": 1000.0}')]
    assert loose.best.label == "vllm" and loose.runner_up is None and loose.missing == ["native"]
    assert groups[("A800", '{"ttft": 500.0}')].best.rate == 3.0


def test_a_later_search_of_the_same_target_replaces_the_earlier(db):
    _store_capacity(db, "vllm", 8.0, run="old")
    _store_capacity(db, "vllm", 6.0, run="new")
    (r,) = recommend(store.capacities(db))
    assert (r.best.rate, r.best.run_group) == (6.0, "new")


def test_runs_of_different_workloads_or_slos_are_refused_together(db):
    _store_capacity(db, "vllm", 8.0, run="a")
    _store_capacity(db, "native", 10.0, run="b", workload="chat in=1024 out=128")
    _store_capacity(db, "native", 10.0, run="c", slos={"ttft": 200.0})
    rows = store.capacities(db)
    with pytest.raises(ValueError, match="workloads differ"):
        select(rows, ["a", "b"])
    with pytest.raises(ValueError, match="SLOs differ"):
        select(rows, ["a", "c"])
    with pytest.raises(ValueError, match="no capacity search in run"):
        select(rows, ["a", "zzz"])


def test_two_servers_of_known_capacity_searched_and_ranked_from_the_command_line(tmp_path):
    # 2 slots and 4 slots, 0.2 s per request: 10 and 20 requests/s (slow enough that the client, sharing this
    # process with both servers, never sets the pace); a 180 ms TTFT SLO holds below both
    db, runs = tmp_path / "store.sqlite", tmp_path / "runs"
    with serve_app(create_mock_app("m", ttft_s=0.1, itl_s=0.05, max_concurrency=2)) as small, \
            serve_app(create_mock_app("m", ttft_s=0.1, itl_s=0.05, max_concurrency=4)) as large:
        result = CliRunner().invoke(cli, [
            "loadtest", "run", "--target", f"{small}#m@test box", "--target", f"{large}#m@test box", "--requests", "20",
            "--input-len", "16", "--output-len", "3", "--warmup", "0", "--capacity", "--goodput", "ttft:180",
            "--precision", "0.1", "--db", str(db), "--out", str(runs)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "capacity at SLO" in result.output
    report = next(runs.iterdir()) / "report.html"
    assert "<h2>recommendation</h2>" in report.read_text() and (report.parent / "capacity.png").exists()
    again = CliRunner().invoke(cli, ["loadtest", "report", "--db", str(db), "--out", str(tmp_path / "again")])
    assert again.exit_code == 0 and "<h2>recommendation</h2>" in (tmp_path / "again" / "report.html").read_text()
    ranked = CliRunner().invoke(cli, ["loadtest", "recommend", "--db", str(db), "--json"])
    assert ranked.exit_code == 0, ranked.output
    (r,) = json.loads(ranked.output)
    assert r["best"]["label"] == f"m@{large}" and r["runner_up"]["label"] == f"m@{small}"
    assert 0.6 <= r["margin"] <= 1.4, r  # 20 against 10 requests/s
    assert r["hardware"] == "test box" and r["slos"] == {"slos_ms": {"ttft": 180.0}, "attainment": 0.9}
