"""Outputs of a run: console table, summary.json / CSV / per-request JSONL, and PNG plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loadtest.extras import require
from loadtest.runner import TargetResult, result_to_json

PLOTTING = "plotting (--plots)"

CSV_FIELDS = ["label", "url", "model", "completed", "failed", "duration", "request_throughput", "output_throughput",
              "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
              "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms",
              "median_e2el_ms", "p99_e2el_ms", "max_concurrent_requests", "p99_send_lag_ms", "request_goodput"]


def console_table(summaries: list[dict], console: Console | None = None) -> None:
    """One column per target, side by side."""
    console = console or Console()
    table = Table(title="burstgate load test", show_lines=False)
    table.add_column("metric")
    for s in summaries:
        table.add_column(s.get("label", s["model"]), justify="right")
    rows = [("completed / failed", lambda s: f"{s['completed']} / {s['failed']}"),
            ("duration (s)", lambda s: f"{s['duration']:.2f}"),
            ("requests/s", lambda s: f"{s['request_throughput']:.2f}"),
            ("output tok/s", lambda s: f"{s['output_throughput']:.1f}"),
            ("total tok/s", lambda s: f"{s['total_token_throughput']:.1f}")]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        rows.append((f"{metric.upper()} mean/p50/p99 (ms)",
                     lambda s, m=metric: f"{s[f'mean_{m}_ms']:.1f} / {s[f'median_{m}_ms']:.1f} / {s[f'p99_{m}_ms']:.1f}"))
    rows.append(("peak concurrency", lambda s: str(s["max_concurrent_requests"])))
    rows.append(("p99 send lag (ms)", lambda s: f"{s['p99_send_lag_ms']:.2f}"))
    if any("request_goodput" in s for s in summaries):
        rows.append(("goodput (req/s)", lambda s: f"{s.get('request_goodput', 0):.2f}"))
    for name, fmt in rows:
        table.add_row(name, *(fmt(s) for s in summaries))
    console.print(table)
    if len(summaries) > 1:
        base = summaries[0]
        ratios = ", ".join(f"{s.get('label')}: {s['output_throughput'] / base['output_throughput']:.2f}x"
                           for s in summaries[1:] if base["output_throughput"])
        console.print(f"output throughput relative to {base.get('label')}: {ratios}")


def write_files(out: Path, results: list[TargetResult]) -> None:
    """summary.json (list, one object per target), summary.csv, requests-<i>.jsonl, details-<i>.json."""
    out.mkdir(parents=True, exist_ok=True)
    summaries = [r.summary for r in results]
    (out / "summary.json").write_text(json.dumps(summaries, indent=2))
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(summaries)
    for i, r in enumerate(results):
        with (out / f"requests-{i}.jsonl").open("w") as f:
            for rec in r.records:
                f.write(json.dumps({"target": r.summary["label"], **rec.to_json()}) + "\n")
        (out / f"details-{i}.json").write_text(json.dumps(result_to_json(r), indent=2))


def plot(out: Path, labels: list[str], per_target_records: list[list[dict]], summaries: list[dict],
         samples: list[list[dict]]) -> list[Path]:
    """Latency CDFs, box plots, throughput bars, sweep curve and resource use over time (PNG)."""
    require("matplotlib", PLOTTING).use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    files = []

    def values(records, key):
        return [r[key] * 1000 for r in records if r.get("ok") and r.get(key) is not None]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key in zip(axes, ("ttft", "tpot", "e2el")):
        for label, recs in zip(labels, per_target_records):
            v = np.sort(values(recs, key))
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size, label=label)
        ax.set_xlabel(f"{key.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("latency CDFs")
    files.append(_save(fig, out / "latency_cdf.png"))

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key in zip(axes, ("ttft", "tpot", "e2el")):
        ax.boxplot([values(recs, key) or [0] for recs in per_target_records], tick_labels=labels, showfliers=False)
        ax.set_ylabel(f"{key.upper()} (ms)")
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle("latency per target")
    files.append(_save(fig, out / "latency_box.png"))

    fig, ax = plt.subplots(figsize=(6 + len(labels), 4))
    ax.bar(labels, [s["output_throughput"] for s in summaries])
    ax.set_ylabel("output tokens/s")
    ax.tick_params(axis="x", rotation=20)
    files.append(_save(fig, out / "throughput.png"))

    if len(summaries) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([s["p99_e2el_ms"] for s in summaries], [s["output_throughput"] for s in summaries], "o-")
        for s, label in zip(summaries, labels):
            ax.annotate(label, (s["p99_e2el_ms"], s["output_throughput"]), fontsize=7)
        ax.set_xlabel("p99 E2E latency (ms)")
        ax.set_ylabel("output tokens/s")
        ax.set_title("throughput vs p99 latency")
        files.append(_save(fig, out / "sweep.png"))

    if any(samples):
        fig, (cpu_ax, mem_ax) = plt.subplots(1, 2, figsize=(12, 4))
        for label, ss in zip(labels, samples):
            t = [s["t"] for s in ss]
            if any(s["cpu_percent"] is not None for s in ss):
                cpu_ax.plot(t, [s["cpu_percent"] or 0 for s in ss], label=f"{label} CPU %")
            if any(s["gpu_memory_used"] for s in ss):
                mem_ax.plot(t, [sum(s["gpu_memory_used"]) / 2**30 for s in ss], label=f"{label} GPU GiB")
            elif any(s["rss_bytes"] for s in ss):
                mem_ax.plot(t, [(s["rss_bytes"] or 0) / 2**30 for s in ss], label=f"{label} RSS GiB")
        cpu_ax.set_xlabel("s")
        mem_ax.set_xlabel("s")
        cpu_ax.legend(fontsize=8)
        mem_ax.legend(fontsize=8)
        fig.suptitle("server resources over time")
        files.append(_save(fig, out / "resources.png"))
    return files


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
