"""The load tester's plots and system sampling need the ``loadtest`` extra; the serving image leaves it out."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = "pip install 'burstgate[loadtest]'"


class MissingExtraError(ImportError):
    """A module of the ``loadtest`` extra is not installed."""


def require(module: str, purpose: str) -> ModuleType:
    """``module`` imported, or a ``MissingExtraError`` that says what needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(f"{purpose} needs {module.split('.')[0]}, from the loadtest extra: {INSTALL}") from exc
