"""Outputs of a run, all in the run's own folder: console table, summary.json / CSV, one vLLM-format result
file per measurement, per-request JSONL, PNG plots and one self-contained HTML report (plots inlined)."""

from __future__ import annotations

import base64
import csv
import html
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table

from loadtest.extras import require
from loadtest.metrics import RequestRecord
from loadtest.recommend import Recommendation, describe_settings, describe_slos
from loadtest.runner import TargetResult, result_to_json
from loadtest.vllm_result import file_name, vllm_result

PLOTTING = "plotting (--plots)"

CSV_FIELDS = ["label", "hardware", "url", "model_id", "workload", "completed", "failed", "duration",
              "request_throughput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
              "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
              "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
              "max_concurrent_requests", "p99_send_lag_ms", "request_goodput", "short_outputs",
              "prompt_tokens_mismatched"]


@dataclass
class Measured:
    """One target at one point, as the reports need it (from a fresh run or from the results store)."""

    name: str  # target label, plus the sweep point
    target: str  # target label alone: a sweep draws one line per target
    summary: dict
    records: list[RequestRecord]
    samples: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    capacity: dict | None = None  # the capacity search this point was a probe of


def from_result(result: TargetResult) -> Measured:
    s = result.summary
    return Measured(s["label"] + s["point"], s["label"], s, result.records, [x.__dict__ for x in result.samples],
                    result.warnings, result.capacity.to_json() if result.capacity else None)


def from_stored(row: dict) -> Measured:
    summary = row["summary"]
    return Measured(summary["label"] + summary["point"], summary["label"], summary,
                    [RequestRecord.from_json(r) for r in row["records"]], row["details"].get("samples", []),
                    row["details"].get("warnings", []), row["details"].get("capacity"))


# ------------------------------------------------------------------------------------------ console
def console_table(summaries: list[dict], console: Console | None = None) -> None:
    """One column per measurement, side by side."""
    console = console or Console()
    table = Table(title="burstgate load test", show_lines=False)
    table.add_column("metric")
    for s in summaries:
        table.add_column(s["label"], justify="right")
    for name, fmt in _rows(summaries):
        table.add_row(name, *(fmt(s) for s in summaries))
    console.print(table)
    if len(summaries) > 1 and summaries[0]["output_throughput"]:
        base = summaries[0]
        ratios = ", ".join(f"{s['label']}: {s['output_throughput'] / base['output_throughput']:.2f}x"
                           for s in summaries[1:])
        console.print(f"output throughput relative to {base['label']}: {ratios}")


def _rows(summaries: list[dict]) -> list[tuple[str, Callable[[dict], str]]]:
    rows: list[tuple[str, Callable[[dict], str]]] = [("hardware", lambda s: s.get("hardware", "?")),
            ("completed / failed", lambda s: f"{s['completed']} / {s['failed']}"),
            ("duration (s)", lambda s: f"{s['duration']:.2f}"),
            ("requests/s", lambda s: f"{s['request_throughput']:.2f}"),
            ("output tok/s (peak 1 s)", lambda s: f"{s['output_throughput']:.1f} ({s['max_output_tokens_per_s']:.0f})"),
            ("total tok/s", lambda s: f"{s['total_token_throughput']:.1f}"),
            ("input / output tokens", lambda s: f"{s['total_input_tokens']} / {s['total_output_tokens']}")]
    def percentiles(m: str) -> Callable[[dict], str]:
        return lambda s: f"{s[f'mean_{m}_ms']:.1f} / {s[f'median_{m}_ms']:.1f} / {s[f'p99_{m}_ms']:.1f}"

    for metric in ("ttft", "tpot", "itl", "e2el"):
        rows.append((f"{metric.upper()} mean/p50/p99 (ms)", percentiles(metric)))
    rows += [("peak concurrency", lambda s: str(s["max_concurrent_requests"])),
             ("p99 send lag (ms)", lambda s: f"{s['p99_send_lag_ms']:.2f}"),
             ("warm-up requests", lambda s: str(s.get("warmup_requests", 0))),
             ("prompts", lambda s: f"{s.get('prompts', '?')} (seed {s.get('prompt_seed', '?')})")]
    if any(s.get("request_goodput") is not None for s in summaries):
        rows.append(("goodput (req/s)", lambda s: f"{s['request_goodput'] or 0:.2f}"))
    if any("conversations" in s for s in summaries):
        rows.append(("conversations completed / all (per s)",
                     lambda s: f"{s['completed_conversations']} / {s['conversations']} "
                               f"({s['conversation_throughput']:.2f})" if "conversations" in s else "-"))
    if any(s.get("short_outputs") for s in summaries):
        rows.append(("short outputs (ignore_eos ignored)", lambda s: str(s["short_outputs"])))
    return rows


# ------------------------------------------------------------------------------------------- files
def write_files(folder: Path, results: list[TargetResult], measured: list[Measured], plots: bool = True,
                recommendations: Sequence[Recommendation] = ()) -> None:
    """The run folder's files: summary.json (a list, one object per measurement), summary.csv, vllm/*.json
    (vLLM's result schema), requests-<i>.jsonl, details-<i>.json, and with ``plots`` PNGs and report.html."""
    folder.mkdir(parents=True, exist_ok=True)
    write_summaries(folder, [m.summary for m in measured])
    (folder / "vllm").mkdir(exist_ok=True)
    for i, (r, m) in enumerate(zip(results, measured)):
        # The per-request files hold every chunk time (a million floats in a long run): msgspec writes them
        # ~10x faster than json, and the client's CPU per streamed token is a measured figure (client_cpu.py).
        (folder / "vllm" / file_name(r.summary, i)).write_bytes(msgspec.json.encode(vllm_result(r.summary, r.records)))
        with (folder / f"requests-{i}.jsonl").open("wb") as f:
            for rec in r.records:
                f.write(msgspec.json.encode({"target": m.name, **rec.to_json()}) + b"\n")
        (folder / f"details-{i}.json").write_text(json.dumps(result_to_json(r), indent=2))
    if plots:
        write_report(folder, measured, recommendations=recommendations)


def write_summaries(folder: Path, summaries: list[dict]) -> None:
    (folder / "summary.json").write_text(json.dumps(summaries, indent=2))
    with (folder / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(summaries)


def write_report(folder: Path, measured: list[Measured], title: str = "burstgate load test",
                 recommendations: Sequence[Recommendation] = ()) -> Path:
    """Every plot as PNG, and report.html holding the same plots inlined with the numbers and settings."""
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    figures = plots(measured)
    images, notes = {}, {}
    for name, fig in figures.items():
        if not draws_data(fig):  # an empty frame reads as a broken chart: say why there is none
            notes[name] = EMPTY_NOTES.get(name, "nothing to draw in this run")
        else:
            _plain_units(fig)
            buf = io.BytesIO()
            fig.tight_layout()
            fig.savefig(buf, format="png", dpi=100)
            (folder / f"{name}.png").write_bytes(buf.getvalue())
            images[name] = base64.b64encode(buf.getvalue()).decode()
        plt.close(fig)
    path = folder / "report.html"
    path.write_text(_html(title, measured, images, recommendations, notes))
    return path


MIN_SAMPLES = 5  # fewer resource samples than this draw no line: two points make a slope nobody can read
EMPTY_NOTES = {"resources": f"server resources: fewer than {MIN_SAMPLES} samples per measurement (one every "
                            "0.5 s while a local server runs): the run was too short, or no local server was found",
               "itl_distribution": "no inter-token latencies: every answer was a single chunk",
               "memory_vs_concurrency": "no server memory sampled: no local server process was found (give "
                                        "--server-pid), or every point ran shorter than 5 samples",
               "cpu_vs_concurrency": "no server CPU sampled: no local server process was found (give --server-pid), "
                                     "or every point ran shorter than 5 samples",
               "kv_cache_vs_concurrency": "the server exports no KV-cache usage gauge (vllm:kv_cache_usage_perc, "
                                          "burstgate:kv_cache_usage_perc), or every point ran shorter than 5 samples"}


def draws_data(fig) -> bool:
    """Whether any axes of ``fig`` holds data: a line with points, bars or scattered points."""
    for ax in fig.axes:
        if any(len(line.get_xdata()) for line in ax.get_lines() if line.get_transform() is ax.transData):  # no axvline
            return True
        if ax.patches or any(len(c.get_offsets()) for c in ax.collections):
            return True
    return False


def _plain_units(fig) -> None:
    """Axes in plain numbers: no "1e-6+3.264e-1" offsets or scientific notation on linear axes."""
    from matplotlib.ticker import ScalarFormatter

    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            formatter = axis.get_major_formatter()
            if isinstance(formatter, ScalarFormatter):
                formatter.set_useOffset(False)
                formatter.set_scientific(False)


# ------------------------------------------------------------------------------------------- plots
def plots(measured: list[Measured]) -> dict:
    """name → matplotlib figure; every distribution keeps its tail (outliers drawn)."""
    require("matplotlib", PLOTTING).use("Agg")
    figs = {"latency_cdf": _cdfs(measured), "latency_box": _boxes(measured), "throughput": _bars(measured),
            "throughput_over_time": _over_time(measured), "ttft_over_time": _ttft_over_time(measured),
            "itl_distribution": _itl_histogram(measured)}
    if any(sum(m.target == t for m in measured) > 1 for t in {m.target for m in measured}):
        figs["sweep"] = _sweep(measured)
    if any(m.samples for m in measured):
        figs["resources"] = _resources(measured)
    if any(m.capacity for m in measured):
        figs["capacity"] = _capacity(measured)
    if len({m.summary.get("max_concurrency") for m in measured if m.summary.get("max_concurrency")}) > 1:
        figs.update(_against_concurrency(measured))
    return figs


# What the seed's figures draw against batch size (the DeepSpeed article's figures 4-6), here against the client's
# concurrency, its serving counterpart: (name, y label, value of one measurement or None when not measured).
CONCURRENCY_QUANTITIES = (
    ("memory", "server memory at its peak (GPU where sampled, else RSS)", "GiB",
     lambda m: _peak_memory_gib(m.samples)),
    ("cpu", "server CPU, mean over the run", "% of one core", lambda m: _mean(m.samples, "cpu_percent")),
    ("kv_cache", "server KV-cache usage at its peak", "% of blocks", lambda m: _peak(m.samples, "kv_cache_usage", 100)),
    ("throughput", "output throughput", "tokens/s", lambda m: m.summary["output_throughput"]),
    ("latency", "time per output token, median", "TPOT p50 (ms)", lambda m: m.summary["median_tpot_ms"]),
)


def _against_concurrency(measured: list[Measured]) -> dict:
    """One figure per quantity, a line per target through its concurrency points (log2 axis)."""
    from matplotlib.ticker import ScalarFormatter

    figs = {}
    levels = sorted({m.summary["max_concurrency"] for m in measured if m.summary.get("max_concurrency")})
    for name, title, unit, value in CONCURRENCY_QUANTITIES:
        fig, ax = _wide_axes(f"{title}, against concurrency", "concurrency (requests in flight, the client's limit)",
                             unit)
        for target in dict.fromkeys(m.target for m in measured):
            points = sorted(((m.summary["max_concurrency"], value(m)) for m in measured
                             if m.target == target and m.summary.get("max_concurrency")), key=lambda p: p[0])
            points = [(x, y) for x, y in points if y is not None]
            if points:
                ax.plot([x for x, _ in points], [y for _, y in points], "o-", label=target)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        if ax.get_lines():
            ax.legend(fontsize=7)
        figs[f"{name}_vs_concurrency"] = fig
    return figs


def _enough(samples: list[dict]) -> bool:
    return len(samples) >= MIN_SAMPLES


def _peak_memory_gib(samples: list[dict]) -> float | None:
    if not _enough(samples):
        return None
    gpu = [sum(s["gpu_memory_used"]) for s in samples if s.get("gpu_memory_used")]
    rss = [s["rss_bytes"] for s in samples if s.get("rss_bytes")]
    return max(gpu or rss) / 2**30 if gpu or rss else None


def _mean(samples: list[dict], key: str) -> float | None:
    values = [s[key] for s in samples if s.get(key) is not None]
    return float(np.mean(values)) if _enough(samples) and values else None


def _peak(samples: list[dict], key: str, scale: float) -> float | None:
    values = [s[key] for s in samples if s.get(key) is not None]
    return max(values) * scale if _enough(samples) and values else None


def _capacity(measured):
    """Per target, each probe's request rate against its p99 TTFT and the share of requests meeting the SLOs."""
    import matplotlib.pyplot as plt

    fig, (ttft_ax, share_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for target in dict.fromkeys(m.target for m in measured if m.capacity):
        rows = _probe_rows(measured, target)
        curve = sorted((r for r in rows if r["role"] != "throughput"), key=lambda row: row["rate"])
        burst = [r for r in rows if r["role"] == "throughput"]  # all at once: no offered rate, off the curve
        found = next(m.capacity for m in measured if m.target == target and m.capacity)
        for ax, key, scale in ((ttft_ax, "p99_ttft_ms", 1), (share_ax, "attained", 100)):
            line, = ax.plot([r["rate"] for r in curve], [r[key] * scale for r in curve], "o-", label=target)
            ax.plot([r["rate"] for r in burst], [r[key] * scale for r in burst], "x", color=line.get_color(),
                    label=f"{target}: all at once")
            ax.axvline(found["rate"], linestyle=":", color=line.get_color())
    unit = next(m.capacity for m in measured if m.capacity).get("unit", "requests/s")  # one workload a run
    ttft_ax.set(xlabel=f"{unit} (offered; x: all at once, completed)", ylabel="p99 TTFT (ms)")
    share_ax.set(xlabel=unit, ylabel="requests meeting every SLO (%)", ylim=(0, 105))
    for ax in (ttft_ax, share_ax):
        ax.legend(fontsize=7)
        ax.ticklabel_format(useOffset=False, style="plain", axis="y")
    fig.suptitle("capacity at SLO: each probe of the search (dotted: the capacity found)")
    return fig


def _probe_rows(measured: list[Measured], target: str) -> list[dict]:
    """The curve behind one target's capacity: each probe's rate, latency percentiles and SLO attainment."""
    runs = [m for m in measured if m.target == target and m.capacity]
    rows = []
    for probe, m in zip((runs[0].capacity or {})["probes"], runs):  # runs: those with a capacity
        s = m.summary
        rows.append({"role": probe["role"], "rate": probe["rate"] or probe.get("throughput", probe["request_throughput"]),
                     "attained": probe["attained"], "passed": probe["passed"],
                     **{f"{p}_{k}_ms": s[f"{p}_{k}_ms"] for k in ("ttft", "tpot", "itl") for p in ("median", "p99")},
                     "request_goodput": s.get("request_goodput")})
    return rows


def _ms(m: Measured, key: str) -> list[float]:
    return [getattr(r, key) * 1000 for r in m.records if r.ok and getattr(r, key) is not None]


def _cdfs(measured):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key in zip(axes, ("ttft", "tpot", "e2el")):
        for m in measured:
            v = np.sort(_ms(m, key))
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size, label=m.name)
        ax.set_xlabel(f"{key.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("latency CDFs")
    return fig


def _boxes(measured):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key in zip(axes, ("ttft", "tpot", "e2el")):
        ax.boxplot([_ms(m, key) or [0] for m in measured], tick_labels=[m.name for m in measured], showfliers=True)
        ax.set_ylabel(f"{key.upper()} (ms)")
        ax.tick_params(axis="x", rotation=20, labelsize=7)
    fig.suptitle("latency per measurement (whiskers 1.5 IQR, every outlier drawn)")
    return fig


def _bars(measured):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6 + len(measured), 4))
    ax.bar([m.name for m in measured], [m.summary["output_throughput"] for m in measured])
    ax.set_ylabel("output tokens/s")
    ax.tick_params(axis="x", rotation=20, labelsize=7)
    return fig


def _sweep(measured):
    """One line per target through its own sweep points."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for target in dict.fromkeys(m.target for m in measured):
        points = [m for m in measured if m.target == target]
        ax.plot([m.summary["p99_e2el_ms"] for m in points], [m.summary["output_throughput"] for m in points], "o-",
                label=target)
        for m in points:
            ax.annotate(m.name[len(target):].strip(), (m.summary["p99_e2el_ms"], m.summary["output_throughput"]),
                        fontsize=6)
    ax.set_xlabel("p99 E2E latency (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("sweep: throughput vs p99 latency, per target")
    ax.legend(fontsize=7)
    return fig


def token_rate_over_time(records: list[RequestRecord], bins: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """(bin starts in s from the first send, output tokens/s per bin): each request's output tokens spread
    over the chunks that carried them."""
    good = [r for r in records if r.ok and r.chunk_times]
    if not good:
        return np.zeros(0), np.zeros(0)
    start = min(r.actual_send for r in good)
    end = max(r.chunk_times[-1] for r in good)
    edges = np.linspace(0.0, max(end - start, 1e-3), bins + 1)
    times = np.concatenate([np.asarray(r.chunk_times) - start for r in good])
    weights = np.concatenate([np.full(len(r.chunk_times), r.output_tokens / len(r.chunk_times)) for r in good])
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1], counts / np.diff(edges)


def _wide_axes(title: str, xlabel: str, ylabel: str):
    """A figure for one quantity over time or its distribution, one series per target."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    return fig, ax


def _over_time(measured):
    fig, ax = _wide_axes("throughput over time", "s since the first send", "output tokens/s")
    for m in measured:
        t, rate = token_rate_over_time(m.records)
        ax.step(t, rate, where="post", label=m.name)
    ax.legend(fontsize=7)
    return fig


def _ttft_over_time(measured):
    fig, ax = _wide_axes("TTFT over time", "send time (s since the first send)", "TTFT (ms)")
    for m in measured:
        good = [r for r in m.records if r.ok]
        if good:
            start = min(r.actual_send for r in m.records)
            ax.scatter([r.actual_send - start for r in good], [r.ttft * 1000 for r in good], s=8, label=m.name)
    ax.legend(fontsize=7)
    return fig


def _itl_histogram(measured):
    fig, ax = _wide_axes("ITL distribution (log count: the tail stays visible)", "inter-token latency (ms)", "chunks")
    itls = {m.name: [gap * 1000 for r in m.records if r.ok for gap in r.itls] for m in measured}
    values = [v for vs in itls.values() for v in vs]
    if values:  # shared bins, at least 1 µs wide in all (equal gaps leave no range to divide)
        edges = np.linspace(min(values), max(max(values), min(values) + 1e-3), 61)
        for name, vs in itls.items():
            if vs:
                ax.hist(vs, bins=edges, histtype="step", label=name)
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    return fig


def _resources(measured):
    import matplotlib.pyplot as plt

    fig, (cpu_ax, mem_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for m in measured:
        ss = m.samples
        if len(ss) < MIN_SAMPLES:
            continue
        t = [s["t"] for s in ss]
        if any(s["cpu_percent"] is not None for s in ss):
            cpu_ax.plot(t, [s["cpu_percent"] or 0 for s in ss], label=f"{m.name} CPU %")
        if gpu := [(s["t"], sum(s["gpu_memory_used"]) / 2**30) for s in ss if s["gpu_memory_used"]]:
            # a remote server's GPU memory comes from its /metrics, read on fewer samples than the process
            mem_ax.plot(*zip(*gpu, strict=True), label=f"{m.name} GPU GiB")
        elif any(s["rss_bytes"] for s in ss):
            mem_ax.plot(t, [(s["rss_bytes"] or 0) / 2**30 for s in ss], label=f"{m.name} RSS GiB")
    for ax in (cpu_ax, mem_ax):
        ax.set_xlabel("s")
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.suptitle("server resources over time")
    return fig


# -------------------------------------------------------------------------------------------- HTML
_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:right;font-size:13px}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}img{max-width:100%;display:block;margin:1em 0}
.warn{color:#a15c00}"""


def _html(title: str, measured: list[Measured], images: dict[str, str],
          recommendations: Sequence[Recommendation] = (), notes: dict[str, str] | None = None) -> str:
    e = html.escape
    summaries = [m.summary for m in measured]
    head = "".join(f"<th>{e(m.name)}</th>" for m in measured)
    settings = [("server", lambda s: f"{s['url']} ({s['model_id']})"),
                ("hardware", lambda s: f"{s.get('hardware')} ({s.get('hardware_source')})"),
                ("workload", lambda s: s.get("workload", "")),
                ("endpoint / ignore_eos / temperature",
                 lambda s: f"{s.get('endpoint')} / {s.get('ignore_eos')} / {s.get('temperature')}"),
                ("prompt lengths counted by", lambda s: s.get("prompt_lengths_counted_by", "")),
                ("date", lambda s: s.get("date", ""))]
    rows = "".join(f"<tr><td>{e(name)}</td>{''.join(f'<td>{e(str(fmt(s)))}</td>' for s in summaries)}</tr>"
                   for name, fmt in settings + [r for r in _rows(summaries) if r[0] != "hardware"])
    warnings = "".join(f"<li class=warn>{e(m.name)}: {e(w)}</li>" for m in measured for w in m.warnings)
    figures = "".join(f"<h2>{e(name.replace('_', ' '))}</h2><img alt='{e(name)}' src='data:image/png;base64,{data}'>"
                      for name, data in images.items())
    figures += "".join(f"<h2>{e(name.replace('_', ' '))}</h2><p class=note>{e(text)}</p>"
                       for name, text in (notes or {}).items())
    # no icon to fetch: a report opened from a web server asks for none at the server's root
    return (f"<!doctype html><html><head><meta charset='utf-8'><link rel='icon' href='data:,'>"
            f"<title>{e(title)}</title><style>{_STYLE}</style></head>"
            f"<body><h1>{e(title)}</h1>{_recommendation_html(recommendations)}{_capacity_html(measured)}"
            f"<h2>measurements</h2><table><tr><th>metric</th>{head}</tr>{rows}</table>"
            f"{'<h2>warnings</h2><ul>' + warnings + '</ul>' if warnings else ''}{figures}</body></html>")


def _table(header: list[str], rows: list[list[str]]) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _recommendation_html(recommendations: Sequence[Recommendation]) -> str:
    """The run's answer first: per hardware, model, workload and SLO, which target carries the most."""
    if not recommendations:
        return ""
    rows = [[r.hardware, r.model, r.workload, describe_slos(r.slos),
             f"{r.best.label} [{describe_settings(r.best.settings)}]",
             f"{r.best.rate:.2f} {r.best.unit} ({r.best.limited_by})",
             f"{r.runner_up.label} {r.runner_up.rate:.2f} {r.runner_up.unit}" if r.runner_up else "-",
             f"{r.margin:+.0%}" if r.margin is not None else "-", ", ".join(r.missing) or "-"] for r in recommendations]
    return "<h2>recommendation</h2>" + _table(["hardware", "model", "workload", "SLO", "best", "capacity",
                                               "runner-up", "margin", "missing"], rows)


def _capacity_html(measured: list[Measured]) -> str:
    """Per target: its capacity at the SLO and the curve behind it, probe by probe."""
    out = []
    for target in dict.fromkeys(m.target for m in measured if m.capacity):
        found = next(m.capacity for m in measured if m.target == target and m.capacity)
        rows = [[row["role"], f"{row['rate']:.2f}", f"{row['attained']:.0%}", "yes" if row["passed"] else "no",
                 *(f"{row[f'{p}_{k}_ms']:.1f}" for k in ("ttft", "tpot", "itl") for p in ("median", "p99")),
                 f"{row['request_goodput'] or 0:.2f}"] for row in _probe_rows(measured, target)]
        slos = describe_slos(found)
        unit = found.get("unit", "requests/s")
        out.append(f"<h2>capacity of {html.escape(target)}: {found['rate']:.2f} {unit} at {html.escape(slos)} "
                   f"(limited by {html.escape(found['limited_by'])}; precision {found['precision']:.0%})</h2>")
        out.append(_table(["probe", unit, "met SLO", "passed", "TTFT p50", "TTFT p99", "TPOT p50",
                           "TPOT p99", "ITL p50", "ITL p99", "goodput (req/s)"], rows))
    return "".join(out)
