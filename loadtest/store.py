"""Results store: every run appended to SQLite; re-read for reports and the per-hardware leaderboard."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

DEFAULT_DB = Path("results/loadtest.sqlite")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_group TEXT NOT NULL,        -- one `loadtest run` invocation (several targets side by side)
    created REAL NOT NULL,
    hardware TEXT NOT NULL,         -- GPU name, else CPU model
    model TEXT NOT NULL,
    url TEXT NOT NULL,
    workload TEXT NOT NULL,         -- e.g. "burst in=512 out=128 n=1000"
    summary TEXT NOT NULL,          -- JSON, vLLM bench field names
    details TEXT NOT NULL           -- JSON: hardware, samples, metrics, warnings
);
"""


def connect(path: Path = DEFAULT_DB) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    db.executescript(_SCHEMA)
    return db


def save(db: sqlite3.Connection, run_group: str, workload: str, summary: dict, details: dict) -> int:
    cur = db.execute(
        "INSERT INTO runs (run_group, created, hardware, model, url, workload, summary, details) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (run_group, time.time(), details.get("hardware", {}).get("hardware", "unknown"), summary["model"],
         summary["url"], workload, json.dumps(summary), json.dumps(details)))
    db.commit()
    return int(cur.lastrowid)


def run_groups(db: sqlite3.Connection) -> list[sqlite3.Row]:
    return db.execute("SELECT run_group, MIN(created) AS created, COUNT(*) AS targets, workload, hardware "
                      "FROM runs GROUP BY run_group ORDER BY created").fetchall()


def load_group(db: sqlite3.Connection, run_group: str) -> list[dict]:
    rows = db.execute("SELECT * FROM runs WHERE run_group = ? ORDER BY id", (run_group,)).fetchall()
    return [{"summary": json.loads(r["summary"]), "details": json.loads(r["details"]), "workload": r["workload"],
             "hardware": r["hardware"]} for r in rows]


def leaderboard(db: sqlite3.Connection, slo_ttft_ms: float | None = None) -> list[dict]:
    """Per (hardware, workload): the fastest target by output throughput, and by p99 TTFT among runs
    meeting the TTFT SLO (all runs when none is given). The workload names the model's tokenizer, so
    targets are compared only on the same model and the same requests."""
    groups: dict[tuple, list[dict]] = {}
    for r in db.execute("SELECT hardware, workload, summary FROM runs").fetchall():
        groups.setdefault((r["hardware"], r["workload"]), []).append(json.loads(r["summary"]))
    board = []
    for (hardware, workload), runs in sorted(groups.items()):
        ok = [s for s in runs if s["completed"] > 0]
        if not ok:
            continue
        by_throughput = max(ok, key=lambda s: s["output_throughput"])
        within = [s for s in ok if slo_ttft_ms is None or s["p99_ttft_ms"] <= slo_ttft_ms]
        by_ttft = min(within, key=lambda s: s["p99_ttft_ms"]) if within else None
        board.append({"hardware": hardware, "workload": workload, "runs": len(runs),
                      "fastest_by_throughput": by_throughput["label"],
                      "output_throughput": by_throughput["output_throughput"],
                      "fastest_by_p99_ttft": by_ttft["label"] if by_ttft else None,
                      "p99_ttft_ms": by_ttft["p99_ttft_ms"] if by_ttft else None})
    return board
