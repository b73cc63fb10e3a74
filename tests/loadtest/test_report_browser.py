"""report.html as a browser shows it (headless Chromium): no console error, every image decodes and draws data
(coloured pixels, not an empty frame), plots without enough data say so in words, and a 1,000-request run's
page stays under 1.5 MB."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gateway.cli import app as cli
from loadtest.mock_server import create_mock_app
from tests.browser import chromium, load
from tests.servers import serve_app

MAX_PAGE_BYTES = 1_500_000

# Per image: its alt text, whether it decoded, and how many pixels are clearly coloured (matplotlib's data
# colours; axes, ticks and text are black, grey or white).
IMAGES = """Promise.all(Array.from(document.images).map(async img => {
  await img.decode().catch(() => null);
  const c = document.createElement('canvas');
  c.width = img.naturalWidth; c.height = img.naturalHeight;
  let coloured = 0;
  if (c.width) {
    const ctx = c.getContext('2d'); ctx.drawImage(img, 0, 0);
    const d = ctx.getImageData(0, 0, c.width, c.height).data;
    for (let i = 0; i < d.length; i += 4)
      if (Math.max(d[i], d[i + 1], d[i + 2]) - Math.min(d[i], d[i + 1], d[i + 2]) > 60) coloured++;
  }
  return [img.alt, img.naturalWidth, coloured];
})).then(images => ({images, notes: Array.from(document.querySelectorAll('p.note')).map(p => p.textContent),
                     tables: document.querySelectorAll('table').length}))"""


@pytest.fixture(scope="module")
def browser():
    with chromium() as devtools:
        yield devtools


def _run(tmp_path: Path, *args: str) -> Path:
    result = CliRunner().invoke(cli, ["loadtest", "run", *args, "--db", str(tmp_path / "store.sqlite"),
                                      "--out", str(tmp_path / "runs"), "--warmup", "0"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    (folder,) = (tmp_path / "runs").iterdir()
    return folder / "report.html"


def _check(browser: str, page: Path) -> dict:
    loaded = load(browser, page, IMAGES)
    assert loaded.errors == []
    value = loaded.value
    assert value["images"], "no images"
    for alt, width, coloured in value["images"]:
        assert width > 0, f"{alt}: did not decode"
        assert coloured > 20, f"{alt}: draws no data"  # an empty frame has none
    return value


def test_a_1000_request_report_renders_cleanly_and_stays_small(browser, tmp_path):
    with serve_app(create_mock_app("m")) as url:
        page = _run(tmp_path, "--target", f"{url}#m@test box", "--requests", "1000", "--input-len", "16",
                    "--output-len", "8")
    assert page.stat().st_size < MAX_PAGE_BYTES
    value = _check(browser, page)
    alts = {alt for alt, _, _ in value["images"]}
    assert {"latency_cdf", "latency_box", "throughput_over_time", "ttft_over_time", "itl_distribution"} <= alts
    # a run of a second or two has too few server samples to draw: said in words, not drawn as two points
    if "resources" not in alts:
        assert any("fewer than 5 samples" in note for note in value["notes"])


def test_a_capacity_report_renders_its_recommendation_and_curve(browser, tmp_path):
    with serve_app(create_mock_app("m", ttft_s=0.02, itl_s=0.01, max_concurrency=2)) as url:
        page = _run(tmp_path, "--target", f"{url}#m@test box", "--requests", "20", "--input-len", "16",
                    "--output-len", "3", "--capacity", "--goodput", "ttft:60", "--precision", "0.2")
    value = _check(browser, page)
    assert "capacity" in {alt for alt, _, _ in value["images"]}
    html = page.read_text()
    assert html.index("<h2>recommendation</h2>") < html.index("<h2>measurements</h2>")
    assert html.count(">hardware<") == 2  # once in the recommendation, once in the measurements' settings
