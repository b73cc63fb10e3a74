"""Help that reads at 80 columns: click's plain two-column layout (rich's boxed tables squeezed option help into
one-word lines), options in sections by their ``rich_help_panel``, and each command's examples printed as written.

Every ``burstgate`` command is declared with ``cls=HelpCommand`` (a group: ``HelpGroup``) and its examples as
``epilog``; the apps are ``typer.Typer(rich_markup_mode=None)`` so that typer hands help to click."""

from __future__ import annotations

from typing import TYPE_CHECKING

from typer.core import TyperCommand, TyperGroup

if TYPE_CHECKING:  # typer vendors its own click: its types, not the click package's
    from typer._click.core import Context
    from typer._click.formatting import HelpFormatter

GENERAL = "Options"  # the section of options declared without a panel (and --help)


def given(ctx: Context, name: str) -> bool:
    """Whether the user set option ``name`` (typer vendors its own click: the source compared by name)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


class _Examples:
    """The epilog as an "Examples" section, its lines as written (click would rewrap them into a paragraph)."""

    epilog: str | None

    def format_epilog(self, ctx: Context, formatter: HelpFormatter) -> None:
        if not self.epilog:
            return
        with formatter.section("Examples"):
            for line in self.epilog.strip("\n").splitlines():
                formatter.write(f"{'':>{formatter.current_indent}}{line}\n" if line else "\n")


class HelpCommand(_Examples, TyperCommand):
    """A typer command whose help groups its options by panel and keeps its examples' lines."""

    def format_options(self, ctx: Context, formatter: HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                section = "Arguments" if param.param_type_name == "argument" else GENERAL
                sections.setdefault(getattr(param, "rich_help_panel", None) or section, []).append(record)
        for name, rows in sections.items():
            with formatter.section(name):
                formatter.write_dl(rows)


class HelpGroup(_Examples, TyperGroup):
    """A typer group whose examples keep their lines."""
