"""Reports: a sweep draws one line per target, distributions keep their tails, throughput over time adds up,
and the HTML page carries its plots inside."""

from __future__ import annotations

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
    assert "http://one" in html and "a warning" in html and "<link" not in html and "<script" not in html
