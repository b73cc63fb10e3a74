"""The README: short enough to read in two minutes, its links alive, its set-up commands the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_readme_is_at_most_150_lines():
    assert len(README.splitlines()) <= 150


def test_every_local_link_and_image_of_the_readme_exists():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [t for t in targets if "://" not in t]
    assert len(local) > 10
    assert [t for t in local if not (ROOT / t).exists()] == []


def test_the_architecture_page_is_linked_from_the_first_screen():
    first_screen = "\n".join(README.splitlines()[:25])
    assert "(docs/architecture.md)" in first_screen


def test_ci_runs_the_readmes_test_command():
    assert "make test " in README and "make serve " in README
    assert "\nmake test\n" in (ROOT / ".ci" / "run").read_text()
