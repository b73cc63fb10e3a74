"""Fitting a device profile on measured steps: the efficiencies and per-step costs that make the step-time model
(``step_time.py``) reproduce them, by a grid over the efficiencies and least squares for the two costs at each,
minimising relative error (attention's own efficiency, where asked, by turns with the grid). Deterministic: the
same points give the same profile.

Points come from the GPU checks' committed results (``gpu_check_*.json``'s step grids, ``cuda_engine_*.json``)
or from the native engine measured here (``measure_native``): every step of a few bursts, timed as the engine
runs it, with the batch it ran."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from backends.native.config import ModelConfig
from backends.sim.profile import SPREAD_POINTS, ProfileSource, StepProfile
from backends.sim.step_time import StepCost, StepTimeModel, StepWork, kv_bytes, part_seconds

ROOT = Path(__file__).resolve().parents[2]
MODEL_CONFIGS = {"design_12b": ROOT / "configs" / "llama-12.3b-gqa.json", "smollm2": ROOT / "configs" / "smollm2-135m.json"}
EFFICIENCY_GRID = np.linspace(0.02, 1.0, 99)
OVERLAP_GRID = np.linspace(0.0, 1.0, 11)  # shares of the shorter time hidden, with --fit-overlap
LAUNCH_GRID = np.concatenate([[0.0], np.geomspace(1e-6, 1e-2, 41)])  # seconds per layer
SPREAD_WINDOW = 21  # steps: a step's own jitter is its time against the median of the steps around it
GRID_CELLS_AT_ONCE = 2_000_000  # (compute, memory, step) cells evaluated together: ~16 MB an array
ATTENTION_ROUNDS = 6  # turns of the attention efficiency's search and the grid's, at most (two or three settle it)
ATTENTION_GAIN = 1e-3  # the least relative fall in error that moves attention off the compute efficiency


@dataclass(frozen=True)
class StepPoint:
    """One measured step: the work of the model it ran and how long it took."""

    cost: StepCost
    work: StepWork
    seconds: float


class _GridFit(NamedTuple):
    """The grid's best cell: its weighted squared error and the parameters that give it."""

    error: float
    compute: float
    whole: float  # nan: the steps run whole compute at ``compute``
    memory: float
    overhead: float
    per_sequence: float
    launch: float
    overlap: float


def fit_profile(points: list[StepPoint], base: StepProfile, compute_from: StepProfile | None = None,
                how: str = "", files: list[str] | None = None, fit_overlap: bool = False,
                spread: bool = False, fit_whole_steps: bool = False, fit_attention: bool = False) -> StepProfile:
    """``base`` (peaks, memory, block size, how steps run) with the efficiencies and costs fitted on ``points``;
    with ``compute_from``, its compute efficiencies and launch cost are taken as given: what points with no
    prefill step cannot show (the same chip and engine measured elsewhere). With ``fit_overlap``, how much a
    part's FLOPs and bytes overlap is fitted too (``memory_overlap``, from 0: they add up, to 1: the roofline, in
    tenths); else ``base`` says. With ``fit_whole_steps``, the steps ``base`` runs whole get a compute efficiency
    of their own (``whole_step_compute_efficiency``: a CPU's fused step runs other kernels than its steps run layer
    by layer). With ``fit_attention``, so does attention (``attention_compute_efficiency``: its own kernels), found by
    turns with the grid of the others. With ``spread`` (points timed one by one), the percentiles of the measured /
    modelled ratios over their mean, each against the steps around it (``local_ratios``), are kept as the profile's
    ``step_spread``."""
    if len(points) < 3:
        raise ValueError(f"a fit needs at least 3 measured steps, got {len(points)}")
    whole = np.array([base.runs_whole(p.work.tokens, p.work.decode_only) for p in points])
    if fit_whole_steps and (whole.all() or not whole.any()):
        raise ValueError(f"a compute efficiency of the steps run whole needs steps run whole and steps that are not; "
                         f"{whole.sum()} of these {len(points)} ran whole")
    if (fit_whole_steps or fit_attention) and compute_from:
        raise ValueError("the compute efficiencies are either fitted on these steps or taken from another profile")
    y = np.array([p.seconds for p in points])
    n = np.array([p.work.sequences for p in points], dtype=float)
    # Relative errors, decode-only steps and steps with prompt tokens weighing the same in all (a burst has
    # many more of the first; TTFT depends on the second)
    decode = np.array([p.work.decode_only for p in points])
    share = np.where(decode, 1 / max(decode.sum(), 1), 1 / max((~decode).sum(), 1))
    grid = _Grid(y, n, share / y**2, _features(points, base), whole, base)
    attention = compute_from.attention_compute_efficiency if compute_from else None
    computes = np.array([compute_from.compute_efficiency]) if compute_from else EFFICIENCY_GRID
    launches = np.array([compute_from.per_layer_launch_s] if compute_from else LAUNCH_GRID)
    overlaps = OVERLAP_GRID if fit_overlap else np.array([base.memory_overlap])
    best = grid.best(computes, launches, overlaps, fit_whole_steps, attention)
    for _ in range(ATTENTION_ROUNDS if fit_attention else 0):  # coordinate descent: each turn lowers the error
        error, moved = grid.best_attention(best)
        if not error < best.error * (1 - ATTENTION_GAIN) or moved == attention:
            break
        attention = moved
        best = grid.best(computes, launches, overlaps, fit_whole_steps, attention)
    fitted = base.model_copy(update={"compute_efficiency": best.compute, "memory_efficiency": best.memory,
                                     "whole_step_compute_efficiency": None if np.isnan(best.whole) else best.whole,
                                     "attention_compute_efficiency": attention,
                                     "step_overhead_s": best.overhead, "per_sequence_s": best.per_sequence,
                                     "per_layer_launch_s": best.launch, "memory_overlap": best.overlap})
    errors = relative_errors(fitted, points)
    if spread:  # around the model's mean: the fit sets a step's expected time, the spread only how it varies
        quantiles = np.quantile(local_ratios(1 / (1 + errors)), np.linspace(0, 1, SPREAD_POINTS))
        drawn_mean = (quantiles.sum() - (quantiles[0] + quantiles[-1]) / 2) / (SPREAD_POINTS - 1)  # of spread_factor
        fitted.step_spread = [float(q) for q in quantiles / drawn_mean]
    fitted.source = ProfileSource(how=how, files=files or [], points=len(points),
                                  median_abs_error=float(np.median(np.abs(errors))),
                                  max_abs_error=float(np.max(np.abs(errors))))
    return fitted


@dataclass
class _Grid:
    """The points of a fit and what its searches share: measured seconds ``y``, sequences ``n``, least-squares
    weights ``w2``, the model's FLOPs and bytes (``_features``) and which steps ran whole."""

    y: np.ndarray
    n: np.ndarray
    w2: np.ndarray
    f: dict[str, np.ndarray]
    whole: np.ndarray
    base: StepProfile

    @functools.cached_property
    def weight_sums(self) -> tuple[float, float, float]:
        """The weights' sums the least squares of ``_costs`` takes: once per fit, not per grid cell."""
        return self.w2.sum(), (self.w2 * self.n).sum(), (self.w2 * self.n * self.n).sum()

    def best(self, computes: np.ndarray, launches: np.ndarray, overlaps: np.ndarray, fit_whole_steps: bool,
             attention: float | None) -> _GridFit:
        """The best cell over the grids of compute efficiency (and of the steps run whole, with
        ``fit_whole_steps``), memory efficiency, launch cost and overlap, the per-step costs by least squares at
        each; attention at ``attention``'s efficiency (None: the compute efficiency of its step)."""
        best = None
        for overlap in overlaps:
            if fit_whole_steps:  # each group's sums on its own efficiency's axis: [sum, launch, compute, whole, memory]
                sums = self.sums(~self.whole, computes, launches, overlap, attention)[:, :, :, None]
                whole_sums = self.sums(self.whole, EFFICIENCY_GRID, launches[:1], overlap, attention)[:, 0, None]
                wholes = EFFICIENCY_GRID
            else:
                sums = self.sums(np.ones_like(self.whole), computes, launches, overlap, attention)[:, :, :, None]
                whole_sums, wholes = np.zeros(1), np.array([np.nan])
            for k, launch in enumerate(launches):
                overhead, per_seq, error = _costs(tuple(sums[:, k] + whole_sums), self.weight_sums)
                error = np.maximum(error, 0)  # expanded sums of squares can round below zero
                i, w, j = np.unravel_index(np.argmin(error), error.shape)
                # a launch cost the steps cannot tell from the overhead (every step launched) ties up to rounding:
                # the candidate found first (the smaller launch cost) stays
                if best is None or error[i, w, j] < best.error - max(1e-9 * best.error, 1e-15):
                    best = _GridFit(float(error[i, w, j]), float(computes[i]), float(wholes[w]),
                                    float(EFFICIENCY_GRID[j]), float(overhead[i, w, j]), float(per_seq[i, w, j]),
                                    float(launch), float(overlap))
        assert best is not None  # the grids are never empty
        return best

    def sums(self, chosen: np.ndarray, computes: np.ndarray, launches: np.ndarray, overlap: float,
             attention: float | None) -> np.ndarray:
        """The residual sums (``_residual_sums``) over the ``chosen`` points at every launch cost, compute efficiency
        and memory efficiency of the grids: an array [sum, launch, compute, memory]."""
        y, n, w2, base = self.y[chosen], self.n[chosen], self.w2[chosen], self.base
        f = {name: column[chosen] for name, column in self.f.items()}
        out = np.zeros((3, len(launches), len(computes), len(EFFICIENCY_GRID)))
        me = EFFICIENCY_GRID[None, :, None]  # [compute, memory, point]
        # compute efficiencies a block at a time: a GPU's served trace has ~10,000 steps, and the whole grid of
        # them at once is gigabytes of temporaries
        cells = len(computes) * len(EFFICIENCY_GRID) * len(y)
        for block in np.array_split(np.arange(len(computes)),
                                    min(len(computes), max(-(-cells // GRID_CELLS_AT_ONCE), 1))):
            ce = computes[block][:, None, None]
            device = (_part(f["linear_flops"] / (base.peak_flops * ce), f["weight_bytes"] / (base.bandwidth * me),
                            overlap)
                      + _part(f["attention_flops"] / (base.peak_flops * (attention or ce)),
                              f["kv_bytes"] / (base.bandwidth * me), overlap)
                      + f["allreduce_s"])
            for k, (_, sums) in enumerate(_residual_sums(y, device, f["launched_layers"], launches, n, w2,
                                                         base.launches_overlap)):
                out[:, k, block] = sums
        return out

    def best_attention(self, at: _GridFit) -> tuple[float, float]:
        """(error, efficiency) of the best attention efficiency of the grid with the rest at ``at``'s cell (the
        per-step costs refitted at each)."""
        base, f = self.base, self.f
        compute = np.where(self.whole & ~np.isnan(at.whole), at.whole, at.compute)  # of each step's linear layers
        linear = _part(f["linear_flops"] / (base.peak_flops * compute), f["weight_bytes"] / (base.bandwidth * at.memory),
                       at.overlap)
        attention = _part(f["attention_flops"] / (base.peak_flops * EFFICIENCY_GRID[:, None]),
                          f["kv_bytes"] / (base.bandwidth * at.memory), at.overlap)  # [efficiency, point]
        (_, sums), = _residual_sums(self.y, linear + attention + f["allreduce_s"], f["launched_layers"], [at.launch],
                                    self.n, self.w2, base.launches_overlap)
        error = np.maximum(_costs(sums, self.weight_sums)[2], 0)
        i = int(np.argmin(error))
        return float(error[i]), float(EFFICIENCY_GRID[i])


def _part(flops_s: np.ndarray, bytes_s: np.ndarray, overlap: float) -> np.ndarray:
    return part_seconds(flops_s, bytes_s, overlap, np.maximum, np.minimum)


def _features(points: list[StepPoint], base: StepProfile) -> dict[str, np.ndarray]:
    """Per point, what the step-time model divides by the peaks: FLOPs and bytes of each part."""
    rows = []
    for p in points:
        c, w = p.cost, p.work
        model = StepTimeModel(base.model_copy(update={"compute_efficiency": 1.0, "memory_efficiency": 1.0}), c)
        rows.append((c.linear_flops_per_token * w.tokens + c.lm_head_flops_per_row * w.sampled_rows, c.weight_bytes,
                     c.attention_flops_per_query_key * w.query_keys, kv_bytes(c, w, base.kv_cache_reuse),
                     model.parts(w)[2], 0 if base.runs_whole(w.tokens, w.decode_only) else c.layers))
    names = ("linear_flops", "weight_bytes", "attention_flops", "kv_bytes", "allreduce_s", "launched_layers")
    return {name: np.array(column, dtype=float) for name, column in zip(names, zip(*rows))}


def _residual_sums(y: np.ndarray, device: np.ndarray, launched: np.ndarray, launch_grid: Iterable[float],
                   n: np.ndarray, w2: np.ndarray, launches_overlap: bool
                   ) -> Iterator[tuple[float, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """For each launch cost of the grid, the weighted sums (``_sums``) of the residual the per-step costs are left
    to explain: the measured time ``y`` less the device's and the launches' (``launched`` layers each). Where the
    launches run after the device's work (a CPU), the sums are polynomials in the launch cost, so the points are
    summed over once, not once per launch cost."""
    if launches_overlap:
        for launch in launch_grid:
            yield launch, _sums(y - np.maximum(device, launch * launched), n, w2)
        return
    free = y - device  # the residual with no launch cost
    # r = free - launch * launched: sum(w2 r) = d - launch dl, sum(w2 n r) = e - launch el,
    # sum(w2 r^2) = rr - 2 launch cross + launch^2 ll
    (d, e, rr), (dl, el, ll) = _sums(free, n, w2), _sums(launched, n, w2)
    cross = (w2 * launched * free).sum(-1)
    for launch in launch_grid:
        yield launch, (d - launch * dl, e - launch * el, rr - 2 * launch * cross + launch**2 * ll)


def _sums(residual: np.ndarray, n: np.ndarray, w2: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The weighted sums over points (the last axis) the least squares of ``_costs`` and its error need."""
    return (w2 * residual).sum(-1), (w2 * n * residual).sum(-1), (w2 * residual * residual).sum(-1)


def _costs(sums: tuple[np.ndarray, np.ndarray, np.ndarray], weight_sums: tuple[float, float, float]
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Non-negative (overhead, per-sequence) explaining a residual by weighted least squares, and the weighted
    squared error left, from the residual's ``_sums`` and the points' (weights; by sequences; by their square);
    where one cost comes out negative, it is zero and the other refitted alone."""
    (d, e, rr), (a, b, c) = sums, weight_sums
    det = a * c - b * b
    if det <= 1e-12 * a * c:  # every step of one size: the two cannot be told apart
        overhead, per_seq = np.maximum(d / a, 0), np.zeros_like(d)
    else:
        overhead, per_seq = (c * d - b * e) / det, (a * e - b * d) / det
        only_per_seq, only_overhead = np.maximum(e / c, 0), np.maximum(d / a, 0)
        overhead, per_seq = np.where(overhead < 0, 0, overhead), np.where(overhead < 0, only_per_seq, per_seq)
        overhead, per_seq = np.where(per_seq < 0, only_overhead, overhead), np.maximum(per_seq, 0)
    error = rr - 2 * overhead * d - 2 * per_seq * e + overhead**2 * a + 2 * overhead * per_seq * b + per_seq**2 * c
    return overhead, per_seq, error


def local_ratios(ratios: np.ndarray, window: int = SPREAD_WINDOW) -> np.ndarray:
    """Each step's measured / modelled ratio (``ratios``, in the order the steps ran) over the median of the
    ``window`` steps around it: its own jitter. A shared host that slows for a minute slows a stretch of steps
    together, and a shape the model misses is missed by the run of like steps around it; neither is a step's own,
    and drawn at random for every simulated step they would make every request's tail."""
    if len(ratios) <= window:
        return ratios / np.median(ratios)
    medians = np.median(np.lib.stride_tricks.sliding_window_view(ratios, window), axis=1)
    # a step near either end takes the window of the steps nearest it: the first or the last
    return ratios / medians[np.clip(np.arange(len(ratios)) - window // 2, 0, len(medians) - 1)]


def relative_errors(profile: StepProfile, points: list[StepPoint]) -> np.ndarray:
    """(modelled - measured) / measured for each point."""
    return np.array([(StepTimeModel(profile, p.cost).seconds_of(p.work) - p.seconds) / p.seconds for p in points])


# ------------------------------------------------------------------------------------ measured points
def model_cost(name_or_path: str | Path, dtype_bytes: int = 2, kv_dtype_bytes: int | None = None,
               tp: int = 1) -> StepCost:
    """The step cost of a model named in ``MODEL_CONFIGS`` or by its config/checkpoint path."""
    from backends.native.weights import open_checkpoint

    path = MODEL_CONFIGS.get(str(name_or_path), Path(name_or_path))
    config: ModelConfig = open_checkpoint(path).config
    return StepCost.of(config, dtype_bytes, kv_dtype_bytes or dtype_bytes, tp)


def points_from_gpu_check(path: Path | str) -> list[StepPoint]:
    """The step grids of a ``make gpu-check`` result (its ``steps`` part): prefill steps of fresh prompts and
    decode steps, per model, timed with CUDA events."""
    grids = json.loads(Path(path).read_text())["parts"]["steps"]["result"]
    points = []
    for model, grid in grids.items():
        cost = model_cost(model)
        for step in grid["steps"]:
            seqs, tokens, context = step["seqs"], step["tokens"], step["context"]
            per_seq = tokens // seqs
            points.append(StepPoint(cost, StepWork.of([per_seq] * seqs, [context] * seqs, seqs), step["ms"] / 1e3))
    return points


def points_from_cuda_engine(paths: list[Path | str]) -> list[StepPoint]:
    """Decode steps of ``benchmarks/cuda_engine.py`` results: the 12.3B model at batch 1, SmolLM2 at the
    burst's batches, replayed from CUDA graphs."""
    points = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        if design := result.get("design_12b"):
            cost, context = model_cost("design_12b"), design["context"]
            points.append(StepPoint(cost, StepWork.of([1], [context], 1), design["graphs_s"]))
        if burst := result.get("smollm2_burst"):
            cost, context = model_cost("smollm2"), 512 + 128 // 2  # the burst's average decode context
            for batch, times in burst["decode_step"].items():
                n = int(batch)
                points.append(StepPoint(cost, StepWork.of([1] * n, [context] * n, n), times["graphs_s"]))
    return points


def measure_native(engine, bursts: list[tuple[int, int, int]]) -> list[tuple[list[int], list[int], int, float, int, int]]:
    """Every step of each burst (requests, prompt tokens, output tokens) through a warmed-up ``LLMEngine``, as
    (query_lens, context_lens, sampled rows, seconds of ``engine.step()``, shared KV tokens, requests admitted): what
    a served step costs, the host's scheduling and bookkeeping included, since on a CPU they do not overlap the
    model."""
    from backends.base import SamplingParams

    steps: list[tuple[list[int], list[int], int, float, int, int]] = []
    execute = engine.runner.execute
    batches = []

    def recording(batch, *args):  # the batch of the step being timed
        batches.append((list(batch.query_lens), list(batch.context_lens), sum(batch.sample),
                        batch.shared_kv_tokens(engine.blocks.block_size), batch.admitted))
        return execute(batch, *args)

    engine.runner.execute = recording
    try:
        for i, (requests, prompt, output) in enumerate(bursts):
            params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
            for r in range(requests):  # distinct prompts: nothing shared in the prefix cache
                ids = [(1000 + 7919 * (i * 4096 + r) + 31 * j) % 40000 + 100 for j in range(prompt)]
                engine.add_request(f"fit-{i}-{r}", ids, params)
            while engine.has_unfinished():
                batches.clear()
                started = time.perf_counter()
                engine.step()
                seconds = time.perf_counter() - started
                if batches:
                    query_lens, context_lens, rows, shared, admitted = batches[-1]
                    steps.append((query_lens, context_lens, rows, seconds, shared, admitted))
            engine.blocks.reset_prefix_cache()
    finally:
        engine.runner.execute = execute
    return steps


def measure_cpu_peaks(dtype, seconds: float = 1.0) -> tuple[float, float]:
    """(FLOP/s of a large matmul in ``dtype``, bytes/s of a large copy, read + written) on this CPU with torch's
    threads as the engine's process set them: the peaks a CPU profile's efficiencies are shares of."""
    import torch

    n = 1024
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    flops = _best_rate(lambda: a @ b, 2 * n**3, seconds)
    src = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB: well past the caches
    dst = torch.empty_like(src)
    bandwidth = _best_rate(lambda: dst.copy_(src), 2 * src.numel() * src.element_size(), seconds)
    return flops, bandwidth


def _best_rate(fn, work: float, seconds: float) -> float:
    fn()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return work / best


# ------------------------------------------------------------------------------------------ profiles
CPU_BURSTS = [(1, 256, 32), (4, 512, 32), (16, 256, 32), (32, 128, 48), (8, 1024, 16), (64, 64, 32)]


def gpu_base_profile(name: str, gpu_name: str) -> StepProfile:
    """What a GPU profile starts from: the GPU type's datasheet, CUDA's block size, decode replayed from graphs."""
    from backends.native.gpus import GPUS

    if gpu_name not in GPUS:
        raise ValueError(f"unknown GPU {gpu_name!r}; choose one of {', '.join(GPUS)}")
    gpu = GPUS[gpu_name]
    return StepProfile(name=name, device=gpu.name, memory_bytes=int(gpu.memory_gib * 2**30),
                       peak_flops=gpu.bf16_tflops * 1e12, bandwidth=gpu.bandwidth_gbs * 1e9, compute_efficiency=1.0,
                       memory_efficiency=1.0, step_overhead_s=0.0, per_sequence_s=0.0,
                       source=ProfileSource(how="unfitted"))


def cpu_base_profile(name: str, steps: dict) -> StepProfile:
    """What a CPU profile starts from: the peaks measured beside its steps, the engine's block size and dtype,
    which steps ran whole (``fused_rows``; a record from before it says only whether decode steps did), and the
    caches serving the reads of KV blocks a step's sequences share (a layer's slice of a block is kilobytes)."""
    if "fused_rows" in steps:
        whole: dict[str, Any] = {"replays_decode": False, "whole_step_tokens": steps["fused_rows"]}
    else:
        whole = {"replays_decode": steps["fused_steps"]}
    return StepProfile(name=name, device=steps["machine"], memory_bytes=None, peak_flops=steps["peaks"]["flops"],
                       bandwidth=steps["peaks"]["bandwidth"], compute_efficiency=1.0, memory_efficiency=1.0,
                       step_overhead_s=0.0, per_sequence_s=0.0, launches_overlap=False, memory_overlap=0.0,
                       kv_cache_reuse=1.0, block_size=steps["block_size"], dtype=steps["dtype"],
                       source=ProfileSource(how="unfitted"),
                       **whole)


def measure_cpu_steps(model: Path | None, bursts: list[tuple[int, int, int]] = CPU_BURSTS) -> dict:
    """The native engine's steps on this CPU (``measure_native``) with the peaks they are shares of."""
    from backends.native.config import EngineConfig
    from backends.native.engine import start_engine
    from backends.native.fused_step import fused_rows
    from gateway.info import machine_summary

    engine = start_engine(EngineConfig(model_path=str(model) if model else None))
    try:
        flops, bandwidth = measure_cpu_peaks(engine.runner.dtype)
        steps = measure_native(engine, bursts)
        return {"what": "native engine steps on a CPU, for `burstgate sim fit --from`", "machine": machine_summary(),
                "model": engine.model_path.name, "model_config": dataclasses.asdict(engine.model_config),
                "dtype": str(engine.runner.dtype).removeprefix("torch."),
                "kv_dtype_bytes": engine.runner.kv_dtype.itemsize, "block_size": engine.blocks.block_size,
                "fused_steps": engine.runner.fused is not None, "fused_rows": fused_rows(engine.runner.fused),
                "peaks": {"flops": flops, "bandwidth": bandwidth},
                "bursts": bursts, "steps": steps}
    finally:
        engine.close()


def points_from_steps(steps: dict) -> list[StepPoint]:
    """The points of ``measure_cpu_steps``'s record (or its saved file's contents)."""
    from backends.native.config import torch_dtype_named

    config = ModelConfig(**steps["model_config"])  # the shape travels with the steps: no checkpoint needed
    cost = StepCost.of(config, torch_dtype_named(steps["dtype"]).itemsize, steps["kv_dtype_bytes"])
    # shared KV tokens where recorded (a step recorded before them has none); the requests a step admitted, which
    # steps recorded since carry after them, are not the model's: a cost per admission fitted on served steps came
    # out zero
    return [StepPoint(cost, StepWork.of(q, c, rows, *shared[:1]), seconds)
            for q, c, rows, seconds, *shared in steps["steps"]]


def load_steps(path: Path | str) -> dict:
    """A JSON file of measured steps, or a step trace of the engine served (JSON lines: backends/native/step_trace.py)
    as the same record; either gzipped where the name ends in ``.gz``."""
    from backends.native.step_trace import open_text, parse_trace

    try:
        with open_text(path) as f:
            text = f.read()
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # a .gz that is not gzip, or truncated
        raise ValueError(f"{path}: cannot be read: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return parse_trace(text.splitlines())
        except (json.JSONDecodeError, StopIteration, KeyError, TypeError, AttributeError):
            raise ValueError(f"{path}: neither measured steps (JSON) nor a step trace (JSON lines)") from None


def points_from_file(path: Path | str) -> tuple[list[StepPoint], bool]:
    """Measured steps from any of the files ``burstgate sim fit --from`` reads, and whether each was timed alone
    (saved steps, a step trace) rather than a grid cell's median (gpu_check, cuda_engine)."""
    data = load_steps(path)
    if "parts" in data:
        return points_from_gpu_check(path), False
    if "steps" in data:
        return points_from_steps(data), True
    if "design_12b" in data or "smollm2_burst" in data:
        return points_from_cuda_engine([path]), False
    raise ValueError(f"{path}: not a gpu_check, cuda_engine, saved-steps or step-trace file")
