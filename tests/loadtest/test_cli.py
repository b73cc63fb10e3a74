"""The command line: bad options are usage errors (exit 2, no traceback), choices are typed, every option is
documented, and the paper preset cannot be silently changed."""

from __future__ import annotations

from importlib.metadata import version

import pytest
import typer
from typer.testing import CliRunner

from gateway.cli import app as cli

TARGET = ["loadtest", "run", "--target", "http://127.0.0.1:9#m", "--requests", "2"]


def _usage_error(args: list[str], *words: str) -> str:
    result = CliRunner().invoke(cli, args, env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # a usage error, not a traceback
    for word in words:
        assert word in result.output, result.output
    return result.output


@pytest.mark.parametrize("args, words", [
    (TARGET + ["--schedule", "poisson"], ["--rate"]),
    (TARGET + ["--rate", "5"], ["--rate"]),
    (TARGET + ["--schedule", "poisson", "--rate", "5", "--burstiness", "0.5"], ["burstiness"]),
    (TARGET + ["--sweep-concurrency", "1,x"], ["--sweep-concurrency"]),
    (TARGET + ["--sweep-rate", "2,-1"], ["--sweep-rate"]),
    (TARGET + ["--endpoint", "embeddings"], ["--endpoint", "completions", "chat"]),
    (TARGET + ["--schedule", "sometimes"], ["--schedule", "burst", "poisson"]),
    (TARGET + ["--goodput", "latency:5"], ["--goodput"]),
    (TARGET + ["--input-len", "9:3"], ["LOW:HIGH"]),
    (TARGET + ["--tokenizer", "a", "--tokenizer", "b"], ["--tokenizer"]),
    (["loadtest", "run", "--hardware", "H100", "--target", "http://x#m"], ["--hardware"]),
    (["loadtest", "run", "--target", "http://x#m@"], ["URL#MODEL[@HARDWARE]"]),
    (["loadtest", "run", "--target", "=http://x#m"], ["[LABEL=]"]),
    (["loadtest", "run", "--requests", "1"], ["--target"]),
    (["serve", "--log-level", "bogus"], ["--log-level", "info", "debug"]),
    # nothing accepted and ignored
    (TARGET + ["--dataset", __file__, "--input-len", "64"], ["--dataset"]),
    (TARGET + ["--num-prefixes", "4"], ["--prefix-len"]),
    (TARGET + ["--schedule", "poisson", "--rate", "2", "--sweep-rate", "1,2"], ["drop --rate"]),
    (TARGET + ["--concurrency", "2", "--sweep-concurrency", "1,2"], ["drop --concurrency"]),
    (TARGET + ["--duration", "5"], ["--duration"]),
    (TARGET[:4] + ["--trace", __file__, "--schedule", "poisson", "--rate", "5"], ["--schedule", "--rate", "--trace"]),
    (TARGET + ["--trace", __file__], ["--requests", "--trace"]),
    (TARGET + ["--time-scale", "0.5"], ["--time-scale", "--trace"]),
    (TARGET[:4] + ["--trace", __file__], ["--trace", "line 1"]),  # not a trace: the bad line is named
    (TARGET + ["--capacity"], ["--goodput"]),
    (TARGET + ["--capacity", "--goodput", "ttft:100", "--sweep", "4"], ["--sweep", "--capacity"]),
    (TARGET + ["--capacity", "--goodput", "ttft:100", "--schedule", "poisson", "--rate", "3"], ["--rate"]),
    (TARGET + ["--sweep", "4", "--concurrency", "8"], ["--concurrency"]),
    (TARGET + ["--precision", "0.1"], ["--capacity"]),
    (["loadtest", "recommend", "--run", "x", "--db", __file__], ["--db"]),
])
def test_bad_options_are_usage_errors(args, words):
    _usage_error(args, *words)


@pytest.mark.parametrize("extra, named", [
    (["--requests", "10"], "--requests"), (["--input-len", "128"], "--input-len"),
    (["--schedule", "poisson", "--rate", "5"], "--schedule"), (["--concurrency", "8"], "--concurrency"),
    (["--output-len", "16:64"], "--output-len"), (["--no-ignore-eos"], "--no-ignore-eos"),
    (["--sweep-rate", "1,2"], "--sweep-rate"),
])
def test_the_paper_preset_refuses_options_that_would_change_it(extra, named):
    _usage_error(["loadtest", "run", "--target", "http://127.0.0.1:9#m", "--preset", "paper", *extra], named, "paper")


def test_version_comes_from_the_package_metadata():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"burstgate {version('burstgate')}"


def _commands(group, prefix: str = ""):
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group (typer vendors its own click)
            yield from _commands(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", command


def test_every_option_has_help_and_a_readable_metavar():
    commands = dict(_commands(typer.main.get_command(cli)))
    assert {"serve", "loadtest run", "loadtest report", "loadtest leaderboard", "loadtest mock-server"} <= commands.keys()
    for name, command in commands.items():
        assert command.help, name
        for param in command.params:
            assert getattr(param, "help", None), f"{name} {param.name} has no help"
        help_text = CliRunner().invoke(cli, [*name.split(), "--help"], env={"COLUMNS": "200"}).output
        assert "list[" not in help_text and "<list" not in help_text, name


def test_choices_are_listed_in_the_help():
    help_text = CliRunner().invoke(cli, ["loadtest", "run", "--help"], env={"COLUMNS": "200"}).output
    for choice in ("burst|poisson|gamma|constant", "completions|chat", "paper"):
        assert choice in help_text
