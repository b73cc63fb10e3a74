"""docs/architecture.md stays true: every file and folder it names exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"`([\w./-]+(?:\.(?:py|c|h|json|yaml|md)|/))`")


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def test_every_file_the_architecture_page_names_exists():
    files = _tracked()
    folders = {str(Path(f).parent) + "/" for f in files} | {"/".join(f.split("/")[:i]) + "/" for f in files
                                                          for i in range(1, f.count("/") + 1)}
    named = set(NAMED.findall((ROOT / "docs" / "architecture.md").read_text()))
    assert len(named) > 40
    missing = [name for name in sorted(named)
               if not any(f == name or f.endswith("/" + name) for f in files)
               and not any(d == name or d.endswith("/" + name) for d in folders)]
    assert missing == []
