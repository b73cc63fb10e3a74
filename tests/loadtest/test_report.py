"""Reports: a sweep draws one line per target, distributions keep their tails, throughput over time adds up,
and the HTML page carries its plots inside."""

from __future__ import annotations

import re

import numpy as np
import pytest

from loadtest.metrics import RequestRecord, summarize
from loadtest.report import Measured, plots, token_rate_over_time, write_report


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def _measured(target: str, point: str, slow: float) -> Measured:
    records = [RequestRecord(i, 0.0, actual_send=0.01 * i, chunk_times=[0.01 * i + slow * k for k in range(1, 5)],
                             output_tokens=4, ok=True) for i in range(20)]
    records.append(RequestRecord(20, 0.0, actual_send=0.0, chunk_times=[50 * slow], output_tokens=1, ok=True))
    summary = summarize(records, 1.0)
    summary.update(label=target, point=point, url="http://x", model_id="m")
    return Measured(target + point, target, summary, records, warnings=["a warning"])


def _sweep():
    return [_measured(t, p, s) for t in ("a@http://one", "b@http://two") for p, s in ((" c=1", 0.01), (" c=4", 0.02))]


def test_a_sweep_draws_one_line_per_target_through_its_own_points():
    figs = plots(_sweep())
    lines = figs["sweep"].axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["a@http://one", "b@http://two"]
    assert all(len(line.get_xdata()) == 2 for line in lines)
    assert "sweep" not in plots(_sweep()[:1])  # a single point is no sweep


def test_box_plots_draw_every_outlier():
    figs = plots(_sweep())
    fliers = [line for line in figs["latency_box"].axes[0].get_lines() if line.get_marker() not in (None, "None", "")]
    assert sum(len(f.get_xdata()) for f in fliers) >= 4  # the slow request of each measurement is drawn


def test_throughput_over_time_adds_up_to_the_output_tokens():
    m = _measured("a", "", 0.01)
    starts, rate = token_rate_over_time(m.records)
    width = np.diff(np.append(starts, starts[-1] + (starts[1] - starts[0])))
    assert float(np.sum(rate * width)) == pytest.approx(sum(r.output_tokens for r in m.records))


def test_the_html_report_is_one_self_contained_file(tmp_path):
    path = write_report(tmp_path, _sweep())
    html = path.read_text()
    for name in ("latency_cdf", "latency_box", "throughput_over_time", "ttft_over_time", "itl_distribution", "sweep"):
        assert (tmp_path / f"{name}.png").exists() and f"alt='{name}'" in html
    assert html.count("src='data:image/png;base64,") == len(list(tmp_path.glob("*.png")))
    assert "http://one" in html and "a warning" in html and "<script" not in html
    # its one link is an empty inline icon, so a browser asks the serving host for no /favicon.ico either
    assert re.findall(r"<link[^>]*>", html) == ["<link rel='icon' href='data:,'>"]


def _at_concurrency(target: str, concurrency: int, rss_gib: float, kv: float | None) -> Measured:
    m = _measured(target, f" concurrency={concurrency}", 0.01 * concurrency)
    m.summary["max_concurrency"] = concurrency
    m.samples = [{"t": 0.5 * i, "cpu_percent": 50.0 * concurrency, "rss_bytes": int(rss_gib * 2**30),
                  "gpu_memory_used": [], "kv_cache_usage": kv} for i in range(6)]
    return m


def test_a_concurrency_sweep_draws_each_quantity_against_concurrency_one_line_per_target():
    measured = [_at_concurrency(t, c, 1.0 + c / 8, 0.1 * c if t == "native" else None)
                for t in ("native", "other") for c in (1, 4, 16)]
    figs = plots(measured)
    memory = figs["memory_vs_concurrency"].axes[0].get_lines()
    assert [line.get_label() for line in memory] == ["native", "other"]
    assert list(memory[0].get_xdata()) == [1, 4, 16] and list(memory[0].get_ydata()) == [1.125, 1.5, 3.0]
    assert list(figs["cpu_vs_concurrency"].axes[0].get_lines()[0].get_ydata()) == [50.0, 200.0, 800.0]
    kv = figs["kv_cache_vs_concurrency"].axes[0].get_lines()  # only the server that exports the gauge
    assert [line.get_label() for line in kv] == ["native"] and list(kv[0].get_ydata()) == pytest.approx([10, 40, 160])


def test_a_remote_servers_gpu_memory_is_drawn_only_where_it_was_read():
    """A remote burstgate's GPU memory comes from its /metrics, read on every other sample or fewer: the samples
    between carry none, and the line joins the readings instead of dropping to zero between them."""
    m = _at_concurrency("native", 1, 1.0, None)
    for i, sample in enumerate(m.samples):
        sample["gpu_memory_used"] = [40 * 2**30, 2 * 2**30] if i % 2 == 0 else []
    memory_axes = plots([m])["resources"].axes[1]
    (line,) = memory_axes.get_lines()
    assert line.get_label().endswith("GPU GiB")
    assert list(line.get_xdata()) == [0.0, 1.0, 2.0] and list(line.get_ydata()) == [42.0, 42.0, 42.0]


def test_too_few_samples_draw_nothing_and_say_so(tmp_path):
    measured = [_at_concurrency("native", c, 1.0, 0.5) for c in (1, 2)]
    for m in measured:
        m.samples = m.samples[:2]
    html = write_report(tmp_path, measured).read_text()
    assert not (tmp_path / "memory_vs_concurrency.png").exists() and not (tmp_path / "resources.png").exists()
    assert "fewer than 5 samples" in html and (tmp_path / "throughput_vs_concurrency.png").exists()
