"""Results store: every run appended to SQLite; re-read for reports and the leaderboard.

The database lives in the user's data directory, whatever the current directory:
``$BURSTGATE_LOADTEST_DB``, else ``$XDG_DATA_HOME/burstgate/loadtest.sqlite`` (``~/.local/share/...``).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

import msgspec

SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_group TEXT NOT NULL,        -- one `loadtest run` invocation (several targets and points)
    created REAL NOT NULL,
    hardware TEXT NOT NULL,         -- the target server's: from its GET /info, or declared (URL#MODEL@HARDWARE)
    model TEXT NOT NULL,
    url TEXT NOT NULL,
    label TEXT NOT NULL,
    workload TEXT NOT NULL,         -- the requests' shape and schedule, e.g. "chat synthetic in=512 out=128 ..."
    failed INTEGER NOT NULL,
    summary TEXT NOT NULL,          -- JSON, vLLM bench field names
    details TEXT NOT NULL,          -- JSON: server info, client hardware, samples, metrics, warnings
    records TEXT NOT NULL           -- JSON list of per-request records
);
CREATE TABLE IF NOT EXISTS capacities (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_group TEXT NOT NULL,
    created REAL NOT NULL,
    hardware TEXT NOT NULL,
    model TEXT NOT NULL,
    url TEXT NOT NULL,
    label TEXT NOT NULL,
    workload TEXT NOT NULL,         -- as runs.workload, less the point: the rates are what the search varied
    slos TEXT NOT NULL,             -- canonical JSON of the SLOs (ms) and the attainment they were held to
    rate REAL NOT NULL,             -- the capacity at those SLOs, in capacity.unit (requests/s, conversations/s)
    limited_by TEXT NOT NULL,       -- slo, throughput or latency floor
    settings TEXT NOT NULL,         -- JSON: the server's deployments (kind, settings) where it reports them
    capacity TEXT NOT NULL,         -- JSON: the search (precision, every probe)
    run_ids TEXT NOT NULL           -- JSON list of runs.id of its probes
);
"""


def default_db() -> Path:
    if env := os.environ.get("BURSTGATE_LOADTEST_DB"):
        return Path(env)
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "burstgate" / "loadtest.sqlite"


def connect(path: Path | None = None) -> sqlite3.Connection:
    """The store at ``path`` (default: ``default_db()``), created on first use."""
    path = path or default_db()
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        db.close()
        raise ValueError(f"{path} is not a results store ({exc})") from None
    has_runs = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'runs'").fetchone() is not None
    if has_runs and version != SCHEMA_VERSION:
        db.close()
        raise ValueError(f"{path} holds results of an older burstgate (its hardware column named the client's "
                         "machine); give another --db")
    db.executescript(_SCHEMA)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    return db


def save(db: sqlite3.Connection, run_group: str, workload: str, summary: dict, details: dict,
         records: list[dict]) -> int:
    cur = db.execute(
        "INSERT INTO runs (run_group, created, hardware, model, url, label, workload, failed, summary, details, "
        "records) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (run_group, time.time(), summary["hardware"], summary["model_id"], summary["url"], summary["label"], workload,
         summary["failed"], json.dumps(summary), json.dumps(details),
         msgspec.json.encode(records).decode()))  # every chunk time: msgspec, ~10x faster than json
    db.commit()
    return _row_id(cur)


def _row_id(cur: sqlite3.Cursor) -> int:
    """The id of the row ``cur``'s INSERT made."""
    assert cur.lastrowid is not None  # sqlite sets it on every INSERT
    return cur.lastrowid


def slo_key(slos_ms: dict[str, float], attainment: float) -> str:
    """One text for one SLO: the same SLOs in any order give the same key."""
    return json.dumps({"slos_ms": dict(sorted(slos_ms.items())), "attainment": attainment}, sort_keys=True)


def save_capacity(db: sqlite3.Connection, run_group: str, workload: str, summary: dict, settings: list[dict],
                  capacity: dict, run_ids: list[int]) -> int:
    """One target's capacity search, pointing at the stored runs of its probes."""
    cur = db.execute(
        "INSERT INTO capacities (run_group, created, hardware, model, url, label, workload, slos, rate, limited_by, "
        "settings, capacity, run_ids) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (run_group, time.time(), summary["hardware"], summary["model_id"], summary["url"], summary["label"], workload,
         slo_key(capacity["slos_ms"], capacity["attainment"]), capacity["rate"], capacity["limited_by"],
         json.dumps(settings), json.dumps(capacity), json.dumps(run_ids)))
    db.commit()
    return _row_id(cur)


def capacities(db: sqlite3.Connection) -> list[dict]:
    """Every stored capacity search, oldest first."""
    rows = db.execute("SELECT * FROM capacities ORDER BY id").fetchall()
    return [{**dict(r), "slos": json.loads(r["slos"]), "settings": json.loads(r["settings"]),
             "capacity": json.loads(r["capacity"]), "run_ids": json.loads(r["run_ids"])} for r in rows]


def run_groups(db: sqlite3.Connection) -> list[sqlite3.Row]:
    return db.execute("SELECT run_group, MIN(created) AS created, COUNT(*) AS targets FROM runs GROUP BY run_group "
                      "ORDER BY created").fetchall()


def load_group(db: sqlite3.Connection, run_group: str) -> list[dict]:
    rows = db.execute("SELECT * FROM runs WHERE run_group = ? ORDER BY id", (run_group,)).fetchall()
    return [{"summary": json.loads(r["summary"]), "details": json.loads(r["details"]),
             "records": json.loads(r["records"]), "workload": r["workload"], "hardware": r["hardware"]} for r in rows]


def leaderboard(db: sqlite3.Connection, slo_ttft_ms: float | None = None) -> list[dict]:
    """Per (server hardware, model, workload): the fastest target by output throughput, and by p99 TTFT
    among runs meeting the TTFT SLO (all runs when none is given). A run with any failed request never
    wins: it did not serve the whole workload."""
    groups: dict[tuple, list[dict]] = {}
    for r in db.execute("SELECT hardware, model, workload, summary FROM runs ORDER BY id").fetchall():
        groups.setdefault((r["hardware"], r["model"], r["workload"]), []).append(json.loads(r["summary"]))
    board = []
    for (hardware, model, workload), runs in sorted(groups.items()):
        clean = [s for s in runs if s["failed"] == 0 and s["completed"] > 0]
        by_throughput = max(clean, key=lambda s: s["output_throughput"], default=None)
        within = [s for s in clean if slo_ttft_ms is None or s["p99_ttft_ms"] <= slo_ttft_ms]
        by_ttft = min(within, key=lambda s: s["p99_ttft_ms"], default=None)
        board.append({"hardware": hardware, "model": model, "workload": workload, "runs": len(runs),
                      "runs_with_failures": len(runs) - len(clean),
                      "fastest_by_throughput": by_throughput["label"] if by_throughput else None,
                      "output_throughput": by_throughput["output_throughput"] if by_throughput else None,
                      "fastest_by_p99_ttft": by_ttft["label"] if by_ttft else None,
                      "p99_ttft_ms": by_ttft["p99_ttft_ms"] if by_ttft else None})
    return board
