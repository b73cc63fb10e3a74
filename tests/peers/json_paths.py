"""The shape of a JSON answer, for the differential tests: every key path it holds."""

from __future__ import annotations

from typing import Any


def key_paths(obj: Any, volatile: set[str], prefix: str = "") -> set[str]:
    """Every key path of a JSON value (list items share the path ``[]``), the ``volatile`` keys left out."""
    if isinstance(obj, dict):
        out = {prefix} if prefix else set()
        for k, v in obj.items():
            if k not in volatile:
                out |= {f"{prefix}.{k}"} | key_paths(v, volatile, f"{prefix}.{k}")
        return out
    if isinstance(obj, list):
        return set().union(*(key_paths(v, volatile, prefix + "[]") for v in obj)) if obj else set()
    return set()
