"""Print the project's requirements, with the extras named, from pyproject.toml: one per line.

The image installs these before it copies the source, so that layer (torch, transformers, DeepSpeed)
survives every code edit:  python requirements.py pyproject.toml [EXTRA ...] > requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """The dependencies and those of ``extras``; the project's references to itself (``name[a,b]``) unfold."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extras {unknown}; {pyproject} has {sorted(optional)}")
    self_reference = re.compile(rf"^{re.escape(project['name'])}\[([^\]]+)\]")
    out: list[str] = []

    def add(requirement: str) -> None:
        if match := self_reference.match(requirement):
            for extra in match.group(1).split(","):
                for r in optional[extra.strip()]:
                    add(r)
        elif requirement not in out:
            out.append(requirement)

    for r in project["dependencies"] + [r for e in extras for r in optional[e]]:
        add(r)
    return out


if __name__ == "__main__":
    print("\n".join(requirements(Path(sys.argv[1]), [e for arg in sys.argv[2:] for e in arg.split(",") if e])))
