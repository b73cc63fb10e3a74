"""Plots and system sampling come with the ``loadtest`` extra; without it ``loadtest run`` stops before
sending anything, with an error that names the extra."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loadtest.extras import MissingExtraError, require
from tests.servers import free_port


def run_without(modules: list[str], *args: str) -> subprocess.CompletedProcess:
    """``burstgate ARGS`` in a fresh interpreter where importing any of ``modules`` fails (as when absent)."""
    code = (f"import sys\nfor m in {modules!r}: sys.modules[m] = None\n"
            f"sys.argv = ['burstgate', *{list(args)!r}]\nfrom gateway.cli import app\napp()")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("missing", ["psutil", "matplotlib"])
def test_loadtest_run_without_the_extra_stops_before_the_run_and_names_it(missing):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the run must not even try
    out = run_without([missing], "loadtest", "run", "--url", url, "--model", "m", "--requests", "1")
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"needs {missing}" in out.stdout and "burstgate[loadtest]" in out.stdout
    assert "Traceback" not in out.stderr


def test_without_plots_matplotlib_is_not_needed(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    out = run_without(["matplotlib"], "loadtest", "run", "--url", url, "--model", "m", "--requests", "1",
                      "--warmup", "0", "--no-plots", "--out", str(tmp_path / "out"), "--db", str(tmp_path / "db"))
    assert out.returncode == 0, out.stdout + out.stderr  # the one request failed (recorded), the run completed
    assert len(list((tmp_path / "out").glob("*/summary.json"))) == 1  # each run writes its own folder


def test_require_names_the_extra_and_keeps_the_cause():
    with pytest.raises(MissingExtraError, match=r"plotting needs no_such_module, from the loadtest extra") as info:
        require("no_such_module.sub", "plotting")
    assert isinstance(info.value.__cause__, ImportError)
