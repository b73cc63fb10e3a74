"""``burstgate sim``: device profiles for simulated replicas (list, fit) and fleets of them on a virtual clock.
Imports stay inside the commands: the gateway's CLI loads this module and must not load torch for it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from backends.native.gpus import GPUS
from gateway.cli_help import HelpCommand, HelpGroup, given

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None, cls=HelpGroup)
FLEET, TRAFFIC, CONVERSATIONS = "The fleet", "Traffic", "Multi-turn conversations"  # `sim run --help`


@app.command(cls=HelpCommand, short_help="The device profiles simulated replicas can run on.", epilog="""
burstgate sim profiles
""")
def profiles() -> None:
    """The device profiles simulated replicas can run on: fitted ones, and GPU types derived from them."""
    from backends.sim.profile import PROFILES_DIR, load_profile, profile_names

    for name in profile_names():
        p = load_profile(name)
        fitted = (PROFILES_DIR / f"{name}.json").exists()
        error = f", median error {p.source.median_abs_error:.1%} on {p.source.points} steps" if fitted else ""
        error += _spread_words(p.step_spread, ", ")
        whole = "" if p.whole_step_compute_efficiency is None else f" ({p.whole_step_compute_efficiency:.0%} run whole)"
        typer.echo(f"{name:<10} {p.device}: compute {p.compute_efficiency:.0%}{whole} of {p.peak_flops / 1e12:,.1f} TFLOP/s, "
                   f"memory {p.memory_efficiency:.0%} of {p.bandwidth / 1e9:,.0f} GB/s"
                   + (error if fitted else " (derived)"))


@app.command(cls=HelpCommand, short_help="Fit a device profile on measured steps.", epilog="""
# a GPU's profile from a committed GPU run
burstgate sim fit --gpu h200 --from benchmarks/results/gpu_check_h200.json \\
    --out h200.json

# this CPU's profile, from the native engine measured here
burstgate sim fit --native --save-steps steps.json --out cpu.json
""")
def fit(
    out: Annotated[Path, typer.Option(metavar="FILE", help="Where to write the profile (JSON).")],
    gpu: Annotated[str | None, typer.Option(metavar="GPU", help=f"The GPU type measured: {', '.join(GPUS)} "
                                            "(its datasheet peaks; the efficiencies are fitted).")] = None,
    measured: Annotated[list[Path] | None, typer.Option("--from", exists=True, dir_okay=False, metavar="FILE",
                                                 help="Measured steps: a gpu_check_*.json, a cuda_engine_*.json, "
                                                 "steps saved by --native --save-steps, or a served engine's "
                                                 "step_trace, gzipped or not (repeatable).")] = None,
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
    fit_overlap: Annotated[bool, typer.Option("--fit-overlap", help="Fit how much of a part's shorter time (its "
                                              "FLOPs' or its bytes') hides behind the longer, in tenths from 0 (they "
                                              "add up) to 1 (the roofline).")] = False,
    fit_whole_steps: Annotated[bool, typer.Option("--fit-whole-steps", help="Fit a compute efficiency of its own for "
                                                  "the steps that run whole: a CPU's fused step, whose kernels are "
                                                  "not those of the steps run layer by layer.")] = False,
    fit_attention: Annotated[bool, typer.Option("--fit-attention", help="Fit a compute efficiency of its own for "
                                                "attention's query-key products, whose kernels are not the linear "
                                                "layers' (found by turns with the others' grid).")] = False,
    memory_overlap: Annotated[float | None, typer.Option(min=0.0, max=1.0, metavar="SHARE", help="Take that share as "
                                                         "given instead (default: a CPU's 0, a GPU's 1).")] = None,
    kv_cache_reuse: Annotated[float | None, typer.Option(min=0.0, max=1.0, metavar="SHARE", help="The share of the "
                                                         "reads of KV blocks several of a step's sequences share that "
                                                         "the caches serve (default: a CPU's 1, a GPU's 0).")] = None,
    spread: Annotated[bool | None, typer.Option("--spread/--no-spread", help="Keep the measured steps' spread "
                                                "around the model, each step against the steps around it (its own "
                                                "jitter), for simulated steps to draw from (default: when "
                                                "each step was timed alone: --native, saved steps, step traces; not "
                                                "a grid's medians).", show_default=False)] = None,
) -> None:
    """Fit a device profile on measured steps and write it: a GPU's from committed GPU results, a CPU's from
    the native engine run here."""
    from backends.sim import fit as fitting

    measured = measured or []
    if fit_overlap and memory_overlap is not None:
        raise typer.BadParameter("either fit the overlap or give it", param_hint="--fit-overlap / --memory-overlap")
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
        try:
            base = fitting.gpu_base_profile(name or gpu, gpu)
            files = [fitting.points_from_file(path) for path in measured]
            points = [p for file_points, _ in files for p in file_points]
            one_by_one = all(alone for _, alone in files)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--gpu / --from") from None
    else:  # a CPU: its measured peaks travel with its steps
        if not native:
            if len(measured) != 1:
                raise typer.BadParameter("a CPU profile is fitted on one saved-steps file (or give --gpu)",
                                         param_hint="--from")
            try:
                steps = fitting.load_steps(measured[0])
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--from") from None
        if "peaks" not in steps:  # GPU results and a GPU's trace carry no measured peaks
            raise typer.BadParameter(f"{measured[0]}: no CPU peaks measured beside these steps; for a GPU's steps give "
                                     "--gpu", param_hint="--from")
        base = fitting.cpu_base_profile(name or "cpu", steps)
        points = fitting.points_from_steps(steps)
        one_by_one = True
    from backends.sim.profile import load_profile

    if memory_overlap is not None:
        base = base.model_copy(update={"memory_overlap": memory_overlap})
    if kv_cache_reuse is not None:
        base = base.model_copy(update={"kv_cache_reuse": kv_cache_reuse})
    fixed = load_profile(compute_from) if compute_from is not None else None
    how = " ".join(["burstgate sim fit", *(f"--gpu {gpu}",) * bool(gpu), *(f"--from {f}" for f in measured_files),
                    *(f"--compute-from {compute_from}",) * bool(compute_from), *("--native",) * native,
                    *(f"--name {name}",) * bool(name), *("--fit-overlap",) * fit_overlap,
                    *("--fit-whole-steps",) * fit_whole_steps,
                    *("--fit-attention",) * fit_attention,
                    *([] if memory_overlap is None else [f"--memory-overlap {memory_overlap:g}"]),
                    *([] if kv_cache_reuse is None else [f"--kv-cache-reuse {kv_cache_reuse:g}"]),
                    *([] if spread is None else ["--spread" if spread else "--no-spread"])])
    try:
        profile = fitting.fit_profile(points, base, fixed, how=how, files=measured_files, fit_overlap=fit_overlap,
                                      spread=one_by_one if spread is None else spread, fit_whole_steps=fit_whole_steps,
                                      fit_attention=fit_attention)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--from") from None
    profile.save(out)
    whole, attention = profile.whole_step_compute_efficiency, profile.attention_compute_efficiency
    typer.echo(f"{profile.name}: compute {profile.compute_efficiency:.0%}"
               f"{'' if whole is None else f' ({whole:.0%} in steps run whole)'}"
               f"{'' if attention is None else f', attention {attention:.0%}'}, memory {profile.memory_efficiency:.0%}, "
               f"step overhead {profile.step_overhead_s * 1e3:.2f} ms, per sequence {profile.per_sequence_s * 1e6:.1f} us, "
               f"per layer launched {profile.per_layer_launch_s * 1e6:.1f} us, overlap {profile.memory_overlap:g}; "
               f"over {profile.source.points} steps "
               f"median error {profile.source.median_abs_error:.1%}, max {profile.source.max_abs_error:.1%}"
               f"{_spread_words(profile.step_spread, '; ')} -> {out}")


def _spread_words(spread: list[float] | None, before: str) -> str:
    """A profile's step spread in a few words (its 5th to 95th percentile), or nothing without one."""
    return f"{before}step spread p5-p95 {spread[5]:.2f}-{spread[95]:.2f}" if spread else ""


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def build_workload(requests: int, input_len: int, output_len: int | None, rate: float | None, arrivals: str,
                   seed: int, prefix_len: int = 0, num_prefixes: int = 1, users: int = 0, turns: int = 1,
                   system_prompt_len: int = 0, question_len: int = 64, think_time: float = 0.0,
                   trace: Path | None = None, time_scale: float = 1.0, dataset: Path | None = None,
                   tokenizer=None, user_history_len: int = 0) -> list:
    """The simulated requests the options describe, named as the load tester names them: a trace, a load-test
    dataset (its prompts through ``tokenizer``; its own output lengths unless ``output_len``), ``users``
    conversations of ``turns`` turns sharing a ``system_prompt_len`` system prompt, each with ``user_history_len``
    tokens of its own before its first question (started at ``rate``), or
    ``requests`` single prompts (sharing ``prefix_len`` tokens within ``num_prefixes`` groups)."""
    from backends.sim import virtual
    from loadtest.schedule import Schedule, arrival_offsets

    if trace is not None:
        return virtual.trace_workload(trace, time_scale=time_scale, seed=seed)
    if prefix_len >= input_len and not users and dataset is None:
        raise typer.BadParameter(f"the shared prefix ({prefix_len}) must be shorter than the prompt ({input_len})",
                                 param_hint="--prefix-len")
    try:
        schedule = Schedule(arrivals) if rate is not None else Schedule.burst
        offsets = arrival_offsets(schedule, users or requests, rate=rate, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--arrivals") from None
    if dataset is not None:
        try:
            return virtual.dataset_workload(dataset, tokenizer, requests, output_len, offsets, seed)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--dataset") from None
    output_len = output_len or 128
    if users:
        return virtual.conversation_workload(users, turns, system_prompt_len, question_len, output_len, offsets,
                                             think_time, seed, user_history_len)
    return virtual.burst_workload(requests, input_len, output_len, offsets, seed, prefix_len, num_prefixes)


def _conflict(ctx: typer.Context, users: int) -> str | None:
    """Options that shape another kind of traffic than the one asked for, as the load tester refuses them."""
    set_here = [name for name in ctx.params if given(ctx, name)]
    if users and (shaping := [n for n in ("requests", "input_len", "prefix_len", "num_prefixes", "dataset", "trace")
                              if n in set_here]):
        return (f"--users sends --users x --turns conversation turns: drop "
                f"{', '.join('--' + n.replace('_', '-') for n in shaping)}")
    conversational = ("turns", "system_prompt_len", "user_history_len", "question_len", "think_time")
    if not users and (talk := [n for n in conversational if n in set_here]):
        return f"{', '.join('--' + n.replace('_', '-') for n in talk)} shape conversations: add --users"
    return None


def routing_config(policy: str, options: Sequence[str] = ()):
    """The gateway's routing configuration for a policy name, its defaults changed by ``options`` (``KEY=VALUE``,
    each value read as JSON where it is JSON, e.g. ``load_cost_tokens=256``), checked by the policy's own model."""
    from pydantic import ValidationError

    from gateway.routing.policy import POLICIES

    if policy not in POLICIES:
        raise typer.BadParameter(f"unknown policy {policy!r}; choose one of {', '.join(sorted(POLICIES))}",
                                 param_hint="--routing")
    settings = {}
    for option in options:
        key, sep, text = option.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{option!r} is not KEY=VALUE", param_hint="--routing-option")
        try:
            settings[key] = json.loads(text)
        except ValueError:
            settings[key] = text
    try:
        return POLICIES[policy].Config(**settings)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(x) for x in error["loc"])
        raise typer.BadParameter(f"{policy}: {where}: {error['msg']}", param_hint="--routing-option") from None


@app.command(cls=HelpCommand, short_help="A fleet of simulated replicas on a virtual clock.", epilog="""
# 64 replicas of the design's 12.3B model on H100s, cache-aware routing
burstgate sim run --model configs/llama-12.3b-gqa.json --profile h100 \\
    --replicas 64 --rate 200 --requests 20000 --routing cache_aware

# the same fleet with cache_aware weighing load 4x more against cached tokens
burstgate sim run --model configs/llama-12.3b-gqa.json --replicas 64 \\
    --rate 200 --requests 20000 --routing-option load_cost_tokens=256

# 48 conversations of 6 turns sharing a 2,000-token system prompt
burstgate sim run --model configs/llama-12.3b-gqa.json --replicas 8 \\
    --users 48 --turns 6 --system-prompt-len 2000 --rate 4
""")
def run(
    ctx: typer.Context,
    model: Annotated[Path, typer.Option(exists=True, metavar="PATH", help="HF directory, .gguf or config.json (only "
                                        "the config is read).", rich_help_panel=FLEET)],
    profile: Annotated[str, typer.Option(metavar="PROFILE", help="Device profile: h100, h200, a GPU type, a CPU "
                                         "profile, or a profile file.", rich_help_panel=FLEET)] = "h100",
    replicas: Annotated[int, typer.Option(min=1, metavar="N", help="Simulated replicas.", rich_help_panel=FLEET)] = 1,
    routing: Annotated[str, typer.Option(metavar="POLICY", help="The gateway's routing policy across them.", rich_help_panel=FLEET)] = "cache_aware",
    routing_option: Annotated[list[str] | None, typer.Option(metavar="KEY=VALUE", help="A setting of the routing "
                              "policy (repeatable), e.g. load_cost_tokens=256.", rich_help_panel=FLEET)] = None,
    requests: Annotated[int, typer.Option(min=1, metavar="N", help="Single prompts (without --users).",
                                          rich_help_panel=TRAFFIC)] = 100,
    input_len: Annotated[int, typer.Option(min=1, metavar="N", help="Prompt tokens.", rich_help_panel=TRAFFIC)] = 512,
    output_len: Annotated[int | None, typer.Option(min=1, metavar="N", help="Output tokens (fixed; default 128, "
                                                   "or a --dataset's own).", rich_help_panel=TRAFFIC)] = None,
    rate: Annotated[float | None, typer.Option(min=0.001, metavar="REQ/S", help="Arrival rate; none: all at t=0.",
                                               rich_help_panel=TRAFFIC)] = None,
    arrivals: Annotated[str, typer.Option(metavar="KIND", help="Arrival process at --rate: poisson, constant or "
                                          "gamma (the load tester's).", rich_help_panel=TRAFFIC)] = "poisson",
    prefix_len: Annotated[int, typer.Option(min=0, metavar="N", help="Tokens shared by the prompts of a group.",
                                            rich_help_panel=TRAFFIC)] = 0,
    num_prefixes: Annotated[int, typer.Option(min=1, metavar="N", help="Groups sharing a prefix.", rich_help_panel=TRAFFIC)] = 1,
    users: Annotated[int, typer.Option(min=0, metavar="N", help="Multi-turn chat: this many conversations, each "
                                       "turn carrying the whole history (the load tester's --users).",
                                       rich_help_panel=CONVERSATIONS)] = 0,
    turns: Annotated[int, typer.Option(min=1, metavar="N", help="Questions per conversation.",
                                       rich_help_panel=CONVERSATIONS)] = 1,
    system_prompt_len: Annotated[int, typer.Option(min=0, metavar="N", help="Tokens of the system prompt every "
                                                   "conversation shares.", rich_help_panel=CONVERSATIONS)] = 0,
    user_history_len: Annotated[int, typer.Option(min=0, metavar="N", help="Tokens of each conversation's own "
                                                  "context before its first question.",
                                                  rich_help_panel=CONVERSATIONS)] = 0,
    question_len: Annotated[int, typer.Option(min=1, metavar="N", help="Tokens of each question.",
                                              rich_help_panel=CONVERSATIONS)] = 64,
    think_time: Annotated[float, typer.Option(min=0, metavar="S", help="Seconds between an answer and the next "
                                              "question.", rich_help_panel=CONVERSATIONS)] = 0.0,
    trace: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, metavar="FILE",
                                               help="A Mooncake-format trace instead.", rich_help_panel=TRAFFIC)] = None,
    time_scale: Annotated[float, typer.Option(min=0.0001, metavar="X", help="Trace times multiplied by X.", rich_help_panel=TRAFFIC)] = 1.0,
    dataset: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, metavar="FILE", help="Prompts from "
                                                 "a load-test dataset (JSONL, ShareGPT or Alpaca JSON) instead.", rich_help_panel=TRAFFIC)] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1, metavar="N", help="Each engine's concurrency.", rich_help_panel=FLEET)] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option(min=16, metavar="N", help="Each engine's step budget.", rich_help_panel=FLEET)] = 8192,
    tensor_parallel_size: Annotated[int, typer.Option(min=1, metavar="N", help="GPUs per replica.", rich_help_panel=FLEET)] = 1,
    spread: Annotated[bool, typer.Option("--spread/--no-spread", help="Each step's time drawn from the profile's "
                                         "measured step spread, where it has one (--no-spread: the modelled time).",
                                         rich_help_panel=FLEET)] = True,
    seed: Annotated[int, typer.Option(metavar="N", help="Seed of the prompts, arrivals, tie-breaks and step "
                                      "spread's draws.", rich_help_panel=TRAFFIC)] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """A fleet of simulated replicas on a virtual clock, routed by the gateway's own policies: what a client
    would measure, without the fleet."""
    import time

    from backends.native.config import EngineConfig, SimulationConfig
    from backends.sim.virtual import VirtualFleet, engine_tokenizer

    if conflict := _conflict(ctx, users):
        raise typer.BadParameter(conflict, param_hint="options")

    try:
        engine = EngineConfig(model_path=str(model), simulate=SimulationConfig(profile=profile, real_time=False,
                                                                               spread=spread),
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              tensor_parallel_size=tensor_parallel_size)
        tokenizer = engine_tokenizer(engine)
        work = build_workload(requests, input_len, output_len, rate, arrivals, seed, prefix_len, num_prefixes, users,
                              turns, system_prompt_len, question_len, think_time, trace, time_scale, dataset,
                              tokenizer, user_history_len)
        fleet = VirtualFleet(engine, replicas, routing_config(routing, routing_option or []), tokenizer, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    started = time.perf_counter()
    result = fleet.run(work)
    host_s = time.perf_counter() - started
    s = result.summary
    hits = [r["prefix_cache_hit_rate"] for r in result.per_replica.values() if r["prefix_cache_hit_rate"] is not None]
    if as_json:
        typer.echo(json.dumps({"summary": s, "per_replica": result.per_replica, "steps": result.steps,
                               "virtual_s": result.virtual_s, "host_s": host_s}, indent=2))
        return
    typer.echo(f"{replicas} x {model.name} on {profile}, routing {routing}: {s['completed']} requests "
               f"({s['failed']} failed) in {s['duration']:.1f} s simulated ({host_s:.1f} s here, {result.steps} steps)")
    typer.echo(f"output {s['output_throughput']:,.0f} tok/s  TTFT p50/p99 {s['median_ttft_ms']:,.0f}/"
               f"{s['p99_ttft_ms']:,.0f} ms  TPOT p50/p99 {s['median_tpot_ms']:.1f}/{s['p99_tpot_ms']:.1f} ms  "
               f"prefix-cache hit rate {sum(hits) / len(hits) if hits else 0:.0%}")
