"""The results store and the leaderboard: like is compared with like (server hardware, model, workload), and
a run that failed any request never wins."""

from __future__ import annotations

import json
import sqlite3

import pytest
from typer.testing import CliRunner

from gateway.cli import app as cli
from loadtest import store

WORKLOAD = "completions synthetic n=100 in=512 out=128 ignore_eos=True schedule=burst"


def _run(label: str, hardware: str, model: str, tok_s: float, p99_ttft: float, failed: int = 0,
         workload: str = WORKLOAD) -> tuple:
    summary = {"label": label, "hardware": hardware, "model_id": model, "url": f"http://{label}", "failed": failed,
               "completed": 100 - failed, "output_throughput": tok_s, "p99_ttft_ms": p99_ttft}
    return workload, summary


def _board(db) -> list[dict]:
    result = CliRunner().invoke(cli, ["loadtest", "leaderboard", "--db", str(db), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_one_winner_per_server_hardware_model_and_workload(tmp_path):
    db = tmp_path / "runs.sqlite"
    runs = [
        _run("vllm", "8x NVIDIA A800-SXM4-80GB", "Llama-2-7b", 900, 80),
        _run("tgi", "8x NVIDIA A800-SXM4-80GB", "Llama-2-7b", 800, 70),
        _run("vllm", "8x NVIDIA A800-SXM4-80GB", "Llama-2-70b", 200, 400),
        _run("tgi", "8x NVIDIA A800-SXM4-80GB", "Llama-2-70b", 250, 500),
        _run("vllm", "8x NVIDIA GeForce RTX 4090", "Llama-2-7b", 500, 90),
        _run("tgi", "8x NVIDIA GeForce RTX 4090", "Llama-2-7b", 600, 95),
        _run("vllm", "8x NVIDIA GeForce RTX 4090", "Llama-2-70b", 40, 900),
        # fastest on paper, but it dropped requests: it must not win anything
        _run("lightllm", "8x NVIDIA GeForce RTX 4090", "Llama-2-70b", 99999, 1, failed=3),
        _run("tgi", "8x NVIDIA GeForce RTX 4090", "Llama-2-70b", 60, 700),
    ]
    with store.connect(db) as conn:
        for workload, summary in runs:
            store.save(conn, "g", workload, summary, {}, [])
    board = _board(db)
    winners = {(r["hardware"], r["model"]): (r["fastest_by_throughput"], r["fastest_by_p99_ttft"]) for r in board}
    assert winners == {
        ("8x NVIDIA A800-SXM4-80GB", "Llama-2-70b"): ("tgi", "vllm"),
        ("8x NVIDIA A800-SXM4-80GB", "Llama-2-7b"): ("vllm", "tgi"),
        ("8x NVIDIA GeForce RTX 4090", "Llama-2-70b"): ("tgi", "tgi"),
        ("8x NVIDIA GeForce RTX 4090", "Llama-2-7b"): ("tgi", "vllm"),
    }
    assert len(board) == 4 and all(r["workload"] == WORKLOAD for r in board)
    row = next(r for r in board if r["model"] == "Llama-2-70b" and "4090" in r["hardware"])
    assert row["runs"] == 3 and row["runs_with_failures"] == 1
    table = CliRunner().invoke(cli, ["loadtest", "leaderboard", "--db", str(db)])
    assert table.exit_code == 0 and "leaderboard" in table.output


def test_other_workloads_and_failed_runs_do_not_mix_in(tmp_path):
    db = tmp_path / "runs.sqlite"
    with store.connect(db) as conn:
        store.save(conn, "g", *_run("a", "h", "m", 10, 1, failed=1), {}, [])
        store.save(conn, "g", *_run("b", "h", "m", 5, 2, workload="chat " + WORKLOAD), {}, [])
    other, only_failed = sorted(_board(db), key=lambda r: r["workload"])
    assert only_failed["fastest_by_throughput"] is None and only_failed["fastest_by_p99_ttft"] is None
    assert other["fastest_by_throughput"] == "b"


def test_the_store_lives_in_the_user_data_dir_whatever_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("BURSTGATE_LOADTEST_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    first = store.default_db()
    monkeypatch.chdir("/")
    assert store.default_db() == first == tmp_path / "data" / "burstgate" / "loadtest.sqlite"
    monkeypatch.setenv("BURSTGATE_LOADTEST_DB", str(tmp_path / "x.sqlite"))
    assert store.default_db() == tmp_path / "x.sqlite"


def test_a_store_of_the_old_schema_is_refused_not_misread(tmp_path):
    old = tmp_path / "old.sqlite"
    with sqlite3.connect(old) as conn:  # the old hardware column named the load tester's machine
        conn.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, hardware TEXT)")
    with pytest.raises(ValueError, match="older"):
        store.connect(old)
    result = CliRunner().invoke(cli, ["loadtest", "leaderboard", "--db", str(old)])
    assert result.exit_code == 2 and "older" in result.output
