"""``burstgate sim``: device profiles for simulated replicas (list, fit) and fleets of them on a virtual clock.
Imports stay inside the commands: the gateway's CLI loads this module and must not load torch for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from backends.native.gpus import GPUS

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.command()
def profiles() -> None:
    """The device profiles simulated replicas can run on: fitted ones, and GPU types derived from them."""
    from backends.sim.profile import PROFILES_DIR, load_profile, profile_names

    for name in profile_names():
        p = load_profile(name)
        fitted = (PROFILES_DIR / f"{name}.json").exists()
        error = f", median error {p.source.median_abs_error:.1%} on {p.source.points} steps" if fitted else ""
        typer.echo(f"{name:<10} {p.device}: compute {p.compute_efficiency:.0%} of {p.peak_flops / 1e12:,.1f} TFLOP/s, "
                   f"memory {p.memory_efficiency:.0%} of {p.bandwidth / 1e9:,.0f} GB/s"
                   + (error if fitted else " (derived)"))


@app.command()
def fit(
    out: Annotated[Path, typer.Option(metavar="FILE", help="Where to write the profile (JSON).")],
    gpu: Annotated[str | None, typer.Option(metavar="GPU", help=f"The GPU type measured: {', '.join(GPUS)} "
                                            "(its datasheet peaks; the efficiencies are fitted).")] = None,
    measured: Annotated[list[Path] | None, typer.Option("--from", exists=True, dir_okay=False, metavar="FILE",
                                                 help="Measured steps: a gpu_check_*.json, a cuda_engine_*.json, "
                                                 "or steps saved by --native --save-steps (repeatable).")] = None,
    compute_from: Annotated[str | None, typer.Option(metavar="PROFILE", help="Take the compute efficiency and launch "
                                                     "cost from this profile (the same chip and engine measured "
                                                     "elsewhere) and fit the rest: for data with no prefill step.")] = None,
    native: Annotated[bool, typer.Option("--native", help="Measure the native engine on this machine's CPU and "
                                         "fit on its steps.")] = False,
    model: Annotated[Path | None, typer.Option(metavar="PATH", help="With --native: the model (default: the "
                                               "embedded SmolLM2).")] = None,
    save_steps: Annotated[Path | None, typer.Option(metavar="FILE", help="With --native: save the measured steps "
                                                    "(the profile can be refitted from them with --from).")] = None,
    name: Annotated[str | None, typer.Option(metavar="NAME", help="The profile's name (default: --gpu, or cpu).")] = None,
) -> None:
    """Fit a device profile on measured steps and write it: a GPU's from committed GPU results, a CPU's from
    the native engine run here."""
    from backends.sim import fit as fitting

    measured = measured or []
    if native and measured:
        raise typer.BadParameter("--native measures the steps here; --from reads measured ones", param_hint="--from")
    if native:
        steps = fitting.measure_cpu_steps(model)
        if save_steps is not None:
            save_steps.write_text(json.dumps(steps) + "\n")
        measured_files = [_relative(save_steps)] if save_steps else []
    elif not measured:
        raise typer.BadParameter("fit on measured steps (--from FILE), or measure them here (--native)",
                                 param_hint="--from / --native")
    else:
        measured_files = [_relative(path) for path in measured]
    if gpu is not None:
        if native:
            raise typer.BadParameter("--native measures this machine's CPU, not a GPU", param_hint="--gpu")
        base = fitting.gpu_base_profile(name or gpu, gpu)
        points = [p for path in measured for p in fitting.points_from_file(path)]
    else:  # a CPU: its measured peaks travel with its steps
        if not native:
            if len(measured) != 1:
                raise typer.BadParameter("a CPU profile is fitted on one saved-steps file (or give --gpu)",
                                         param_hint="--from")
            steps = json.loads(measured[0].read_text())
        base = fitting.cpu_base_profile(name or "cpu", steps)
        points = fitting.points_from_steps(steps)
    from backends.sim.profile import load_profile

    fixed = load_profile(compute_from) if compute_from is not None else None
    how = "burstgate sim fit " + " ".join(_argv_tail())
    profile = fitting.fit_profile(points, base, fixed, how=how, files=measured_files)
    profile.save(out)
    typer.echo(f"{profile.name}: compute {profile.compute_efficiency:.0%}, memory {profile.memory_efficiency:.0%}, "
               f"step overhead {profile.step_overhead_s * 1e3:.2f} ms, per sequence {profile.per_sequence_s * 1e6:.1f} us, "
               f"per layer launched {profile.per_layer_launch_s * 1e6:.1f} us; over {profile.source.points} steps "
               f"median error {profile.source.median_abs_error:.1%}, max {profile.source.max_abs_error:.1%} -> {out}")


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _argv_tail() -> list[str]:
    import sys

    argv = sys.argv[1:]
    return argv[argv.index("fit") + 1:] if "fit" in argv else argv


def machine() -> str:
    """This machine in words: CPU model and the cores this process may use."""
    import os

    from gateway.info import cpu_model

    return f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores"
