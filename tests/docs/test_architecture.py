"""docs/architecture.md stays true: every file and folder it names exists, and the native engine's file table
names files of backends/native/."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "architecture.md").read_text()
NAMED = re.compile(r"`([\w./-]+(?:\.(?:py|c|h|json|yaml|md)|/))`")


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def test_every_file_the_architecture_page_names_exists():
    files = _tracked()
    folders = {"/".join(f.split("/")[:i]) + "/" for f in files for i in range(1, f.count("/") + 1)}
    named = set(NAMED.findall(PAGE))
    assert len(named) > 40
    missing = [name for name in sorted(named)
               if not any(f == name or f.endswith("/" + name) for f in files)
               and not any(d == name or d.endswith("/" + name) for d in folders)]
    assert missing == []


def test_the_native_engine_table_names_its_own_files():
    table = PAGE.split("## Native engine: the files", 1)[1]
    first_cells = [row.split("|")[1] for row in table.splitlines() if row.startswith("| `")]
    named = [name for cell in first_cells for name in NAMED.findall(cell)]
    assert len(named) > 20
    native = ROOT / "backends" / "native"
    assert [name for name in named if not (native / name).exists()] == []
