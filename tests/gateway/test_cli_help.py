"""`burstgate --help` and every subcommand's help: readable at 80 columns, options grouped, examples that run."""

from __future__ import annotations

import shlex

import pytest
import typer
from typer.testing import CliRunner

from gateway.cli import app

ROOT = typer.main.get_command(app)


def _is_group(command) -> bool:
    return hasattr(command, "commands")


def _commands(group, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    found = [(path, group)]
    for name, command in group.commands.items():
        if _is_group(command):
            found += _commands(command, (*path, name))
        else:
            found.append(((*path, name), command))
    return found


COMMANDS = _commands(ROOT)


def _help(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    return result.output


def _examples(text: str) -> list[list[str]]:
    """The command lines under "Examples:" (continuation lines joined), each without "burstgate" and comments."""
    logical, pending = [], ""
    for line in text.split("\nExamples:\n", 1)[1].splitlines():
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        logical.append(pending)
        pending = ""
    return [shlex.split(line, comments=True)[1:] for line in logical if line.startswith("burstgate ")]


def test_every_command_is_covered():
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"serve", "plan", "loadtest run", "loadtest report", "sim run", "sim fit"} <= names


@pytest.mark.parametrize("path", [path for path, _ in COMMANDS], ids=lambda p: " ".join(p) or "burstgate")
def test_help_reads_at_80_columns_and_shows_examples(path):
    text = _help(path)
    too_wide = [line for line in text.splitlines() if len(line) > 80]
    assert not too_wide, too_wide
    assert "\nExamples:\n" in text
    assert _examples(text), "an Examples section with no command in it"


@pytest.mark.parametrize("path", [path for path, _ in COMMANDS], ids=lambda p: " ".join(p) or "burstgate")
def test_examples_name_only_commands_and_options_that_exist(path):
    commands = dict(COMMANDS)
    for example in _examples(_help(path)):
        words = [w for w in example if not w.startswith("-")]
        # the example's command: the longest known path its leading words spell
        target = max((p for p in commands if tuple(words[:len(p)]) == p), key=len)
        assert not _is_group(commands[target]), f"burstgate {' '.join(example)}: no such command"
        known = {opt for param in commands[target].params for opt in (*param.opts, *param.secondary_opts)}
        unknown = [w.split("=")[0] for w in example if w.startswith("--") and w.split("=")[0] not in known]
        assert not unknown, f"burstgate {' '.join(example)}: {unknown}"


def test_long_option_lists_are_grouped_into_sections():
    text = _help(("loadtest", "run"))
    for section in ("Targets:", "Workload:", "Multi-turn conversations:", "Trace replay:", "Arrivals and sweeps:",
                    "Goodput and capacity at an SLO:", "Output:"):
        assert f"\n{section}\n" in text
    serve = _help(("serve",))
    for section in ("Server:", "Parallelism:", "HTTPS:"):
        assert f"\n{section}\n" in serve


def test_option_help_keeps_most_of_the_width():
    """rich's boxed tables pushed option help past column 50 at 80 columns: one or two words a line."""
    for path, _ in COMMANDS:
        indents = [len(line) - len(line.lstrip()) for line in _help(path).splitlines() if line.strip()]
        assert max(indents) <= 36, " ".join(path)
