"""The code's own checks, in the suite so that CI holds them: ruff's rule set (pyproject.toml) over every package,
the tests, the benchmarks and the docs generator, and mypy over the three packages, gateway/, backends/ (the native
engine included) and loadtest/ (pydantic's plugin)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    result = _run("ruff", "check", "gateway", "backends", "loadtest", "tests", "benchmarks", "docs/generate.py")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_gateway_the_backends_and_the_load_tester_type_check(tmp_path):
    result = _run("mypy", "--cache-dir", str(tmp_path), "gateway", "backends", "loadtest")
    assert result.returncode == 0, result.stdout + result.stderr
