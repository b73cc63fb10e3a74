"""``loadtest recommend``: from stored capacity searches, the target to run per (server hardware, model, workload,
SLO), the runner-up and the margin between them, each with the runs behind it.

Only searches of the same workload at the same SLOs (and attainment) on the same hardware and model are ranked
together; a target measured there under another workload or SLO is listed as missing, not ranked. A target
searched more than once in a group counts with its latest search (its settings may have changed since).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class Entry:
    """One target's capacity in a group."""

    label: str
    rate: float  # at the SLO, in ``unit``
    limited_by: str
    run_group: str
    run_ids: list[int]
    settings: list[dict]  # the server's deployments, where it reports them
    unit: str = "requests/s"  # or conversations/s (a multi-turn workload: its group's every entry)


@dataclass
class Recommendation:
    hardware: str
    model: str
    workload: str
    slos: dict  # {"slos_ms": {...}, "attainment": x}
    best: Entry
    runner_up: Entry | None = None
    margin: float | None = None  # best / runner-up - 1 (None without a runner-up or when it has no capacity)
    missing: list[str] = field(default_factory=list)  # targets measured on this hardware, not for this group

    def to_json(self) -> dict:
        return asdict(self)


def select(rows: list[dict], run_groups: list[str]) -> list[dict]:
    """The capacity rows of the named runs, refused when their workloads or SLOs differ (nothing to rank)."""
    chosen = [r for r in rows if r["run_group"] in run_groups]
    if unknown := set(run_groups) - {r["run_group"] for r in chosen}:
        raise ValueError(f"no capacity search in run(s) {', '.join(sorted(unknown))}")
    for what, key in (("workloads", "workload"), ("SLOs", "slos"), ("models", "model")):
        if len(values := {json.dumps(r[key], sort_keys=True) for r in chosen}) > 1:
            raise ValueError(f"these runs cannot be ranked together: their {what} differ ({'; '.join(sorted(values))})")
    return chosen


def recommend(rows: list[dict]) -> list[Recommendation]:
    """One recommendation per (hardware, model, workload, SLO) group of stored capacity rows."""
    groups: dict[tuple, dict[str, dict]] = {}
    for row in rows:  # oldest first: a later search of the same target replaces an earlier one
        key = (row["hardware"], row["model"], row["workload"], json.dumps(row["slos"], sort_keys=True))
        groups.setdefault(key, {})[row["label"]] = row
    measured_on: dict[tuple[str, str], set[str]] = {}
    for hardware, model, _, _ in groups:
        measured_on.setdefault((hardware, model), set())
    for (hardware, model, _, _), by_label in groups.items():
        measured_on[(hardware, model)] |= set(by_label)
    out = []
    for (hardware, model, workload, slos), by_label in sorted(groups.items()):
        entries = sorted((_entry(r) for r in by_label.values()), key=lambda e: e.rate, reverse=True)
        best, runner_up = entries[0], entries[1] if len(entries) > 1 else None
        margin = best.rate / runner_up.rate - 1 if runner_up is not None and runner_up.rate > 0 else None
        missing = sorted(measured_on[(hardware, model)] - set(by_label))
        out.append(Recommendation(hardware, model, workload, json.loads(slos), best, runner_up, margin, missing))
    return out


def _entry(row: dict) -> Entry:
    return Entry(row["label"], row["rate"], row["limited_by"], row["run_group"], row["run_ids"], row["settings"],
                 row["capacity"].get("unit", "requests/s"))  # (stored before conversations: requests)


def describe_slos(slos: dict) -> str:
    """``ttft<=500ms tpot<=50ms for 90%``."""
    limits = " ".join(f"{k}<={v:g}ms" for k, v in slos["slos_ms"].items())
    return f"{limits} for {slos['attainment']:.0%}"


def describe_settings(settings: list[dict]) -> str:
    """The deployments' kinds, e.g. ``native`` (the full settings are in the JSON output)."""
    return ", ".join(d.get("kind", "?") for d in settings) or "not reported"
