"""Device profiles are fitted, never guessed: the fit finds the parameters that made a set of steps, the committed
profiles come back from the data they name, and a CPU's steps are measured from the real engine
(backends/sim/fit.py, `burstgate sim fit`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from backends.sim.fit import StepPoint, fit_profile, model_cost, relative_errors
from backends.sim.profile import PROFILES_DIR, ProfileSource, StepProfile, load_profile
from backends.sim.step_time import StepTimeModel, StepWork
from gateway.cli import app

ROOT = Path(__file__).resolve().parents[3]


def _gpu(**changes) -> StepProfile:
    fields = dict(name="made", device="a made-up GPU", memory_bytes=80 << 30, peak_flops=1e15, bandwidth=3e12,
                  compute_efficiency=1.0, memory_efficiency=1.0, step_overhead_s=0.0, per_sequence_s=0.0,
                  source=ProfileSource(how="test"))
    return StepProfile(**{**fields, **changes})


@pytest.mark.parametrize("cells_at_once", [None, 20_000])  # the grid whole, and a block of ~2 efficiencies at a time
@pytest.mark.parametrize("launches_overlap", [True, False])  # a GPU's launches beside its work, a CPU's after
def test_the_fit_recovers_the_profile_that_made_the_steps(cells_at_once, launches_overlap, monkeypatch):
    if cells_at_once is not None:
        monkeypatch.setattr("backends.sim.fit.GRID_CELLS_AT_ONCE", cells_at_once)
    truth = _gpu(compute_efficiency=0.5, memory_efficiency=0.8, step_overhead_s=0.002, per_sequence_s=1e-5,
                 per_layer_launch_s=1e-4, launches_overlap=launches_overlap)
    points = []
    for model in ("design_12b", "smollm2"):
        cost = model_cost(model)
        shapes = [([512] * n, [512] * n) for n in (1, 4, 16)] + [([1] * n, [c] * n) for n in (1, 16, 64, 256)
                                                                 for c in (512, 2048)]
        for q, c in shapes:
            work = StepWork.of(q, c, len(q))
            points.append(StepPoint(cost, work, StepTimeModel(truth, cost).seconds_of(work)))
    fitted = fit_profile(points, _gpu(launches_overlap=launches_overlap))
    assert fitted.compute_efficiency == pytest.approx(0.5) and fitted.memory_efficiency == pytest.approx(0.8)
    assert fitted.per_layer_launch_s == pytest.approx(1e-4)
    assert fitted.step_overhead_s == pytest.approx(0.002, rel=1e-3)
    assert fitted.per_sequence_s == pytest.approx(1e-5, rel=1e-3)
    assert fitted.source.max_abs_error < 1e-3


def test_a_cpus_launch_cost_is_fitted_on_the_steps_its_fused_rows_leave_out():
    """On a CPU whose fused step takes up to 128 rows, prompt tokens or not, only larger steps launch layer by
    layer: the fit charges those alone and recovers the launch cost, and a record of the steps says which ran
    whole (one from before ``fused_rows`` says only whether decodes did)."""
    from backends.sim.fit import cpu_base_profile

    record = {"machine": "a CPU", "peaks": {"flops": 1e12, "bandwidth": 5e10}, "block_size": 64, "dtype": "float32",
              "fused_steps": True, "fused_rows": 128}
    base = cpu_base_profile("cpu", record)
    assert (base.replays_decode, base.whole_step_tokens) == (False, 128)
    earlier = cpu_base_profile("cpu", {k: v for k, v in record.items() if k != "fused_rows"})
    assert (earlier.replays_decode, earlier.whole_step_tokens) == (True, 0)
    truth = base.model_copy(update={"compute_efficiency": 0.5, "memory_efficiency": 0.8, "step_overhead_s": 0.002,
                                    "per_sequence_s": 1e-5, "per_layer_launch_s": 1e-3})
    cost = model_cost("smollm2")
    works = [StepWork.of(q, c, len(q)) for q, c in [([n], [n]) for n in (64, 128, 256, 512)]
             + [([1] * d + [100], [300] * d + [100]) for d in (1, 8, 28, 29, 60)]
             + [([1] * n, [c] * n) for n in (1, 16, 128, 129, 256) for c in (256, 1024)]]
    points = [StepPoint(cost, w, StepTimeModel(truth, cost).seconds_of(w)) for w in works]
    fitted = fit_profile(points, base)
    assert fitted.per_layer_launch_s == pytest.approx(1e-3) and fitted.compute_efficiency == pytest.approx(0.5)
    assert fitted.source.max_abs_error < 1e-3


def test_with_fit_whole_steps_the_steps_run_whole_get_a_compute_efficiency_of_their_own(monkeypatch):
    """A CPU whose fused step computes at 60% of the peak and whose steps launched layer by layer (oneDNN) at 90%:
    the fit finds both, with the overlap and the per-step costs; one efficiency for both cannot make those steps."""
    from backends.sim.fit import cpu_base_profile

    monkeypatch.setattr("backends.sim.fit.EFFICIENCY_GRID", np.linspace(0.1, 1.0, 10))  # tenths: a quick grid

    base = cpu_base_profile("cpu", {"machine": "a CPU", "peaks": {"flops": 1e12, "bandwidth": 5e10}, "block_size": 64,
                                    "dtype": "float32", "fused_steps": True, "fused_rows": 128})
    truth = base.model_copy(update={"compute_efficiency": 0.9, "whole_step_compute_efficiency": 0.6,
                                    "memory_efficiency": 0.8, "memory_overlap": 0.5, "step_overhead_s": 0.002,
                                    "per_sequence_s": 1e-5, "per_layer_launch_s": 1e-3})
    cost = model_cost("smollm2")
    works = [StepWork.of(q, c, len(q)) for q, c in [([n], [n]) for n in (64, 128, 256, 512, 2048)]
             + [([1] * n, [c] * n) for n in (1, 4, 8, 16, 32, 64, 128) for c in (256, 1024)]]
    points = [StepPoint(cost, w, StepTimeModel(truth, cost).seconds_of(w)) for w in works]
    fitted = fit_profile(points, base, fit_overlap=True, fit_whole_steps=True)
    assert (fitted.compute_efficiency, fitted.whole_step_compute_efficiency) == (pytest.approx(0.9), pytest.approx(0.6))
    assert (fitted.memory_efficiency, fitted.memory_overlap) == (pytest.approx(0.8), pytest.approx(0.5))
    assert fitted.per_layer_launch_s == pytest.approx(1e-3) and fitted.source.max_abs_error < 1e-3
    one = fit_profile(points, base, fit_overlap=True)
    assert one.whole_step_compute_efficiency is None and one.source.max_abs_error > 0.02


def _cpu_base():
    from backends.sim.fit import cpu_base_profile

    return cpu_base_profile("cpu", {"machine": "a CPU", "peaks": {"flops": 1e12, "bandwidth": 5e10}, "block_size": 64,
                                    "dtype": "float32", "fused_steps": True, "fused_rows": 128})


# fresh prompts, turns of 64 and 200 tokens over cached histories, decodes: each part of the model shows
TURNS = ([([n], [n]) for n in (64, 128, 256, 512, 2048)] + [([q], [q + c]) for q in (64, 200) for c in (1000, 4000)]
         + [([1] * n, [c] * n) for n in (1, 4, 8, 16, 32, 64, 128) for c in (256, 1024)])


@pytest.mark.parametrize("attention", [0.3, 0.9])  # below and above the compute efficiencies
def test_with_fit_attention_attention_gets_a_compute_efficiency_of_its_own(attention, monkeypatch):
    """A CPU whose attention kernels compute at their own share of the peak, beside a fused step's and the launched
    steps' shares: the fit finds all three, by turns with the grid; with attention at the steps' efficiency, turns
    over long cached histories come out wrong."""
    monkeypatch.setattr("backends.sim.fit.EFFICIENCY_GRID", np.linspace(0.1, 1.0, 10))  # tenths: a quick grid
    base = _cpu_base()
    truth = base.model_copy(update={"compute_efficiency": 0.7, "whole_step_compute_efficiency": 0.5,
                                    "attention_compute_efficiency": attention, "memory_efficiency": 0.8,
                                    "memory_overlap": 0.5, "step_overhead_s": 0.002, "per_sequence_s": 1e-5,
                                    "per_layer_launch_s": 1e-3})
    cost = model_cost("smollm2")
    points = [StepPoint(cost, w, StepTimeModel(truth, cost).seconds_of(w))
              for w in (StepWork.of(q, c, len(q)) for q, c in TURNS)]
    fitted = fit_profile(points, base, fit_overlap=True, fit_whole_steps=True, fit_attention=True)
    assert fitted.attention_compute_efficiency == pytest.approx(attention)
    assert (fitted.compute_efficiency, fitted.whole_step_compute_efficiency) == (pytest.approx(0.7), pytest.approx(0.5))
    assert fitted.source.max_abs_error < 1e-3
    without = fit_profile(points, base, fit_overlap=True, fit_whole_steps=True)
    assert without.attention_compute_efficiency is None and without.source.max_abs_error > 0.02


def test_attention_the_steps_cannot_tell_apart_stays_at_the_steps_compute_efficiency(monkeypatch):
    """Steps made with attention at their own efficiency, and steps with too little attention to show another:
    the fit leaves attention unset (None: the step's efficiency) rather than take any efficiency the error is
    flat over."""
    monkeypatch.setattr("backends.sim.fit.EFFICIENCY_GRID", np.linspace(0.1, 1.0, 10))
    base = _cpu_base()
    truth = base.model_copy(update={"compute_efficiency": 0.7, "whole_step_compute_efficiency": 0.5,
                                    "memory_efficiency": 0.8, "step_overhead_s": 0.002, "per_layer_launch_s": 1e-3})
    cost = model_cost("smollm2")
    for shapes in (TURNS, [([n], [n]) for n in (16, 32, 200, 300)] + [([1] * n, [64] * n) for n in (1, 8, 64)]):
        points = [StepPoint(cost, w, StepTimeModel(truth, cost).seconds_of(w))
                  for w in (StepWork.of(q, c, len(q)) for q, c in shapes)]
        fitted = fit_profile(points, base, fit_whole_steps=True, fit_attention=True)
        assert fitted.attention_compute_efficiency is None and fitted.source.max_abs_error < 1e-3


def test_a_whole_step_efficiency_needs_steps_run_whole_and_others_and_is_not_taken_from_elsewhere():
    from backends.sim.fit import cpu_base_profile

    base = cpu_base_profile("cpu", {"machine": "a CPU", "peaks": {"flops": 1e12, "bandwidth": 5e10}, "block_size": 64,
                                    "dtype": "float32", "fused_steps": True, "fused_rows": 128})
    cost = model_cost("smollm2")
    decodes = [StepPoint(cost, StepWork.of([1] * n, [100] * n, n), 0.01 * n) for n in (1, 2, 4)]
    with pytest.raises(ValueError, match="3 of these 3 ran whole"):
        fit_profile(decodes, base, fit_whole_steps=True)
    prompts = decodes + [StepPoint(cost, StepWork.of([512], [512], 1), 0.2)]
    for own in ({"fit_whole_steps": True}, {"fit_attention": True}):
        with pytest.raises(ValueError, match="either fitted"):
            fit_profile(prompts, base, compute_from=base, **own)


@pytest.mark.parametrize("overlap", [0.0, 0.3, 1.0])  # their sum, part hidden, the roofline
def test_with_fit_overlap_the_fit_finds_how_much_flops_and_bytes_overlap(overlap):
    """Steps made with a share of each part's shorter time (its FLOPs' or its bytes') hidden behind the longer are
    fitted with that share; without --fit-overlap the base profile's share is kept."""
    truth = _gpu(compute_efficiency=0.5, memory_efficiency=0.8, step_overhead_s=0.002, memory_overlap=overlap)
    cost = model_cost("smollm2")
    works = [StepWork.of(q, c, len(q)) for q, c in [([512] * n, [512] * n) for n in (1, 4, 16)]
             + [([1] * n, [c] * n) for n in (1, 8, 16, 64, 256) for c in (256, 512, 2048)]]
    points = [StepPoint(cost, w, StepTimeModel(truth, cost).seconds_of(w)) for w in works]
    other = 1.0 - overlap  # the base starts elsewhere
    fitted = fit_profile(points, _gpu(memory_overlap=other), fit_overlap=True)
    assert fitted.memory_overlap == pytest.approx(overlap) and fitted.source.max_abs_error < 1e-3
    assert fit_profile(points, _gpu(memory_overlap=other)).memory_overlap == other


def test_with_spread_the_fit_keeps_the_percentiles_of_measured_over_modelled_around_their_mean():
    """Steps timed at 0.9, 1 and 1.5 times the model that made them, in turn, over many shapes: the spread keeps
    those proportions (measured over modelled, not the inverse), and a draw from it is 1 on average: the fit
    alone sets a step's expected time."""
    truth = _gpu(compute_efficiency=0.5, memory_efficiency=0.8, step_overhead_s=0.002)
    cost = model_cost("smollm2")
    works = [StepWork.of(q, c, len(q)) for q, c in [([512] * n, [512] * n) for n in (1, 2, 4, 8, 16)]
             + [([1] * n, [c] * n) for n in (1, 8, 16, 64, 256) for c in (256, 512, 2048)]]
    points = [StepPoint(cost, w, StepTimeModel(truth, cost).seconds_of(w) * factor)
              for w in works for factor in (0.9, 1.0, 1.5)]
    fitted = fit_profile(points, _gpu(), spread=True)
    spread = fitted.step_spread
    assert spread is not None and len(spread) == 101
    assert spread[50] / spread[0] == pytest.approx(1.0 / 0.9, rel=0.03)
    assert spread[100] / spread[50] == pytest.approx(1.5, rel=0.03)
    draws = [fitted.spread_factor(u) for u in np.linspace(0, 1, 20_001)]
    assert sum(draws) / len(draws) == pytest.approx(1.0, abs=1e-4)
    assert fit_profile(points, _gpu()).step_spread is None  # not asked: each step takes the model's time


def test_the_spread_is_each_steps_own_jitter_not_a_stretch_of_slow_steps():
    """A shared host that runs a stretch of 100 steps at 1.5 times the model, the rest at it: those steps ran
    slow together (the host's speed that minute), not each on its own, so the spread stays narrow. The same steps
    slow one in ten, scattered, widen its top tenth."""
    truth = _gpu(compute_efficiency=0.5, memory_efficiency=0.8, step_overhead_s=0.002)
    cost = model_cost("smollm2")
    works = [StepWork.of([1] * n, [c] * n, n) for n in (1, 8, 16, 64) for c in (256, 512, 2048)] * 40
    model = [StepTimeModel(truth, cost).seconds_of(w) for w in works]
    stretch = [StepPoint(cost, w, t * (1.5 if 200 <= i < 300 else 1.0)) for i, (w, t) in enumerate(zip(works, model))]
    scattered = [StepPoint(cost, w, t * (1.5 if i % 10 == 0 else 1.0)) for i, (w, t) in enumerate(zip(works, model))]
    calm = fit_profile(stretch, _gpu(), spread=True).step_spread
    jittery = fit_profile(scattered, _gpu(), spread=True).step_spread
    assert calm is not None and jittery is not None
    assert calm[99] / calm[1] < 1.05  # every step near the median of the steps around it
    assert jittery[95] / jittery[50] == pytest.approx(1.5, rel=0.03)


@pytest.mark.parametrize("spread", [[1.0] * 100, [1.0] * 100 + [0.5], [0.0] * 101])
def test_a_step_spread_is_every_percentile_positive_and_in_order(spread):
    with pytest.raises(ValueError, match="step_spread"):
        _gpu(step_spread=spread)


@pytest.mark.parametrize("option, kept", [([], True), (["--no-spread"], False)])
def test_sim_fit_keeps_the_spread_of_steps_timed_one_by_one_unless_told_not_to(option, kept, tmp_path):
    out = tmp_path / "p.json"
    steps = "benchmarks/results/sim_cpu_steps_zen4.json"
    result = CliRunner().invoke(app, ["sim", "fit", "--from", steps, *option, "--out", str(out)])
    assert result.exit_code == 0, result.output
    profile = load_profile(str(out))
    assert (profile.step_spread is not None) == kept and profile.source.how.endswith(f"{steps}{' --no-spread' * (not kept)}")


def test_sim_profiles_lists_each_profile_with_its_fit_and_spread():
    lines = CliRunner().invoke(app, ["sim", "profiles"]).output.splitlines()
    listed = {line.split()[0]: line for line in lines}
    for name in (p.stem for p in PROFILES_DIR.glob("*.json")):
        profile = load_profile(name)
        assert f"on {profile.source.points} steps" in listed[name]
        assert ("p5-p95" in listed[name]) == (profile.step_spread is not None)
    assert listed["a100-80g"].endswith("(derived)")


def test_too_few_steps_are_refused():
    cost = model_cost("smollm2")
    with pytest.raises(ValueError, match="at least 3"):
        fit_profile([StepPoint(cost, StepWork.of([1], [10], 1), 0.01)], _gpu())


@pytest.mark.parametrize("name", sorted(p.stem for p in PROFILES_DIR.glob("*.json")))  # every committed one
def test_each_committed_profile_comes_back_from_the_data_it_names(name, tmp_path):
    committed = load_profile(name)
    command = committed.source.how.split()
    assert command[:3] == ["burstgate", "sim", "fit"]
    out = tmp_path / f"{name}.json"
    result = CliRunner().invoke(app, [*command[1:], "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    refitted, stored = json.loads(out.read_text()), json.loads((PROFILES_DIR / f"{name}.json").read_text())
    (refitted_floats, refitted_rest), (stored_floats, stored_rest) = _split(refitted), _split(stored)
    assert refitted_rest == stored_rest
    assert refitted_floats == pytest.approx(stored_floats, rel=1e-6)  # the same numbers from any machine's BLAS


def _split(profile: dict) -> tuple[dict, dict]:
    """(the profile's float fields, its others), its source's and its step spread's among them."""
    fields = {**{k: v for k, v in profile.items() if k not in ("source", "step_spread")},
              **{f"source.{k}": v for k, v in profile["source"].items()},
              **{f"step_spread.{i}": v for i, v in enumerate(profile["step_spread"] or [])},
              "step_spread": profile["step_spread"] is not None}
    floats = {k: v for k, v in fields.items() if isinstance(v, float)}
    return floats, {k: v for k, v in fields.items() if k not in floats}


def test_the_h200_profile_reproduces_its_measured_steps_within_its_stated_error():
    from backends.sim.fit import points_from_gpu_check

    profile = load_profile("h200")
    errors = relative_errors(profile, points_from_gpu_check(ROOT / "benchmarks/results/gpu_check_h200.json"))
    assert max(abs(errors)) == pytest.approx(profile.source.max_abs_error)
    assert profile.source.median_abs_error < 0.05


def test_a_gpu_type_nobody_measured_borrows_the_h100_efficiencies_and_says_so():
    a100, h100 = load_profile("a100-80g"), load_profile("h100")
    assert a100.compute_efficiency == h100.compute_efficiency and a100.memory_efficiency == h100.memory_efficiency
    assert a100.bandwidth == 2039e9 and a100.memory_bytes == 80 << 30
    assert "not measured" in a100.source.how


def test_an_unknown_profile_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="h100"):
        load_profile("tpu-v5")


@pytest.mark.parametrize("args, message", [
    (["--gpu", "h100"], "fit on measured steps"),
    (["--native", "--from", "benchmarks/results/gpu_check_h200.json"], "--native measures"),
    (["--gpu", "tpu", "--from", "benchmarks/results/gpu_check_h200.json"], "unknown GPU"),
    (["--from", "benchmarks/results/h200_served_steps_rerun.jsonl.gz"], "for a GPU's steps give --gpu"),
    (["--from", "{tmp}/garbage.jsonl"], "neither measured steps (JSON) nor a step trace"),
    (["--from", "{tmp}/garbage.jsonl.gz"], "cannot be read: Not a gzipped file"),
    (["--from", "{tmp}/peaks_without_header_peaks.jsonl"], "neither measured steps (JSON) nor a step trace"),
    (["--gpu", "h200", "--from", "{tmp}/garbage.jsonl.gz"], "cannot be read"),
    (["--gpu", "h200", "--from", "benchmarks/results/gpu_check_h200.json", "--fit-overlap", "--memory-overlap", "0.5"],
     "either fit the overlap or give it"),
    (["--gpu", "h200", "--from", "benchmarks/results/gpu_check_h200.json", "--memory-overlap", "1.5"],
     "--memory-overlap"),
    (["--gpu", "h100", "--from", "benchmarks/results/cuda_engine_h100_design.json", "--from",
      "benchmarks/results/cuda_engine_h100_smollm2.json", "--fit-whole-steps"], "4 of these 4 ran whole"),
])
def test_bad_fits_are_usage_errors(args, message, tmp_path):
    for name in ("garbage.jsonl", "garbage.jsonl.gz"):
        (tmp_path / name).write_text("not steps\n")
    (tmp_path / "peaks_without_header_peaks.jsonl").write_text(  # a closing peaks line, and none in the header
        '{"block_size": 64}\n[[1], [2], 1, 0.01, 0]\n{"peaks": {"flops": 1e11}}\n')
    args = [a.format(tmp=tmp_path) for a in args]
    result = CliRunner().invoke(app, ["sim", "fit", *args, "--out", str(tmp_path / "p.json")])
    assert result.exit_code != 0 and message in " ".join(result.output.split()), result.output


def test_the_native_engine_is_measured_step_by_step(native_engine):
    """Every step of a small burst through the real engine, with the batch it ran."""
    from backends.sim.fit import measure_native

    steps = measure_native(native_engine, [(2, 40, 3)])
    assert steps[0][0] == [40, 40] and steps[0][1] == [40, 40] and steps[0][2] == 2  # both prompts in one step
    assert [s[0] for s in steps[1:]] == [[1, 1]] * 2  # then the two decodes for tokens 2 and 3
    assert all(seconds > 0 for _, _, _, seconds, _, _ in steps)
    assert all(shared == 0 for *_, shared, _ in steps)  # distinct prompts: no block in common
    assert [admitted for *_, admitted in steps] == [2, 0, 0]  # both requests admitted by the first step
    assert not native_engine.has_unfinished()
