"""The documentation: generated pages match the code, the site builds with --strict, and every page opens in a
real browser without console errors, broken links or images, or an empty body."""

from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest

from tests import browser
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_match_the_code():
    assert _generator().stale() == [], "run `python docs/generate.py` and commit the pages"


def test_a_config_field_without_a_description_is_visible_in_the_reference():
    """Every field of the YAML config is described (from its Field description or the comment beside it)."""
    page = _generator().configuration_page()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) > 100
    undescribed = [row.split("|")[1].strip() for row in rows if row.rstrip().endswith("|  |")]
    assert undescribed == []


def test_the_configuration_reference_follows_the_models():
    """A field added to a model appears in the page, with its default and bounds."""
    from pydantic import Field

    from gateway.config import Limits

    class Extended(Limits):
        burst_window_s: float = Field(2.5, gt=0)  # how long a burst may last

    section = "\n".join(_generator()._model_section(Extended, "a test", []))
    assert "| `burst_window_s` | float (> 0) | `2.5` | how long a burst may last |" in section


def test_the_cli_reference_names_every_option_of_every_command():
    import typer

    from gateway.cli import app

    page = _generator().cli_page()
    root = typer.main.get_command(app)
    for command in (root.commands["serve"], root.commands["loadtest"].commands["run"]):
        for param in command.params:
            for opt in param.opts:
                if opt != "--help":
                    assert f"`{opt}" in page, opt


def test_superseded_results_are_listed_apart_from_current_ones():
    page = _generator().results_page()
    current, superseded = page.split("## Superseded runs")
    assert "single_stream.json" not in current.replace("single_stream_", "")
    assert "[single_stream.json]" in superseded and "`single_stream_epyc.json`" in superseded


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@contextlib.contextmanager
def _served(folder: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.targets: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(values["id"])
        for name in ("href", "src"):
            if values.get(name) and tag in ("a", "img", "link", "script"):
                self.targets.append(values[name])


def _parsed(path: Path) -> _Links:
    links = _Links()
    links.feed(path.read_text())
    return links


def _file_of(site: Path, page: Path, target: str) -> tuple[Path, str]:
    """The built file an internal link points at, and its fragment."""
    url = urljoin("http://site/" + page.relative_to(site).as_posix(), target)
    parts = urlsplit(url)
    path = site / unquote(parts.path).lstrip("/")
    return (path / "index.html" if path.is_dir() or parts.path.endswith("/") else path), parts.fragment


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return [p for item in node for p in _nav_pages(item)]


def test_the_site_builds_strict_with_every_page_of_the_nav(site):
    import yaml

    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert len(nav) >= 18
    for page in nav:
        built = "index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html"
        assert (site / built).exists(), page


def _cells(row: str) -> int:
    """The cells of a Markdown table row: split at every pipe not escaped by an odd run of backslashes (as
    Python-Markdown and GitHub split them, code spans included)."""
    count, backslashes = 0, 0
    for char in row.strip().strip("|"):
        if char == "|" and backslashes % 2 == 0:
            count += 1
        backslashes = backslashes + 1 if char == "\\" else 0
    return count + 1


@pytest.mark.parametrize("page", sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")))
def test_every_table_row_has_its_headers_cells(page):
    """A pipe in a cell (a Literal's choices, an option's N|LOW:HIGH) must not split it into another column (the
    renderer drops the cells past the header's: the row's last column vanishes)."""
    ragged, header = [], None
    for number, line in enumerate((ROOT / "docs" / page).read_text().splitlines(), 1):
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = _cells(line)
        elif _cells(line) != header:
            ragged.append(f"{page}:{number}: {_cells(line)} cells, the header has {header}")
    assert ragged == []


def test_every_internal_link_and_image_of_the_site_resolves(site):
    broken = []
    pages = sorted(site.rglob("*.html"))
    ids = {page: _parsed(page).ids for page in pages}
    for page in pages:
        if "assets" in page.relative_to(site).parts:
            continue  # the example load-test report links to the servers it measured
        for target in _parsed(page).targets:
            if urlsplit(target).scheme in ("http", "https", "mailto", "data") or target.startswith("//"):
                continue
            path, fragment = _file_of(site, page, target)
            if not path.exists():
                broken.append(f"{page.relative_to(site)} -> {target}")
            elif fragment and path.suffix == ".html" and fragment not in (ids[path] if path in ids
                                                                          else _parsed(path).ids):
                broken.append(f"{page.relative_to(site)} -> {target} (no such anchor)")
    assert broken == []


CHECK = """(async () => {
  await Promise.all([...document.images].map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })));
  return {
    text: (document.querySelector('article') || document.body).innerText.trim().length,
    broken_images: [...document.images].filter(i => !i.naturalWidth).map(i => i.getAttribute('src')),
  };
})()"""


def test_every_page_opens_in_chromium_without_errors(site):
    pages = [p for p in sorted(site.rglob("index.html")) if p.parent != site / "search"]
    pages.append(site / "assets" / "example-report" / "report.html")
    failures = {}
    with _served(site) as base, browser.chromium() as devtools:
        for page in pages:
            relative = page.relative_to(site).as_posix()
            loaded = browser.load(devtools, f"{base}/{relative}", CHECK)
            value = loaded.value or {}
            problems = [*loaded.errors, *(f"broken image {src}" for src in value.get("broken_images", []))]
            if value.get("text", 0) < 200:
                problems.append(f"almost empty: {value.get('text')} characters")
            if problems:
                failures[relative] = problems
    assert len(pages) >= 17
    assert failures == {}


def test_the_configuration_pages_example_is_a_valid_config(monkeypatch):
    """The annotated YAML of docs/configuration.md loads as a config (its keys read from the environment set)."""
    import re

    import yaml

    from gateway.config import Settings

    text = (ROOT / "docs" / "configuration.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    for name in re.findall(r"os\.environ/(\w+)", example):
        monkeypatch.setenv(name, f"test-value-of-{name}")
    settings = Settings(**yaml.safe_load(example))
    assert settings.models and settings.api_keys and settings.admin_api_keys
