"""A device profile: the peaks of a device and the efficiencies and per-step costs the native engine reaches on
it, fitted on measured steps (``fit.py``), one JSON file per device under ``profiles/`` with the data it was
fitted on named in ``source``. GPU types nobody measured get the datasheet peaks of ``gpus.GPUS`` with the
efficiencies of a measured GPU, and say so."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from backends.native.gpus import GPUS

PROFILES_DIR = Path(__file__).parent / "profiles"
SPREAD_POINTS = 101  # a step spread's quantiles: every percentile, 0 to 100
REFERENCE_GPU_PROFILE = "h100"  # whose efficiencies an unmeasured GPU type borrows
# NVLink 4 (H100 SXM: 900 GB/s both ways) per direction; PCIe 4 x16 for the GeForce and L40S parts
NVLINK_BANDWIDTH, PCIE_BANDWIDTH = 450e9, 32e9


class ProfileSource(BaseModel):
    """Where a profile's numbers come from, and how well they reproduce them."""

    model_config = ConfigDict(extra="forbid")

    how: str  # the command that wrote it, or what it was derived from
    files: list[str] = Field(default_factory=list)  # measurements it was fitted on
    points: int = 0
    median_abs_error: float | None = None  # relative, over the points fitted on
    max_abs_error: float | None = None


class StepProfile(BaseModel):
    """A device as the step-time model (``step_time.py``) sees it."""

    model_config = ConfigDict(extra="forbid")

    name: str
    device: str  # in words, as measured
    memory_bytes: int | None = None  # what the simulated engine's weights and KV cache share; None: a CPU
    peak_flops: float = Field(gt=0)  # bf16 dense (GPUs: datasheet), or measured on a CPU in the engine's dtype
    bandwidth: float = Field(gt=0)  # bytes/s (GPUs: datasheet), or measured on a CPU
    compute_efficiency: float = Field(gt=0, le=1)  # of peak_flops, fitted
    memory_efficiency: float = Field(gt=0, le=1)  # of bandwidth, fitted
    # of peak_flops in the steps that run whole where they run kernels of their own (a CPU's fused C step: strips of
    # weights streamed under a broadcast-FMA loop, not oneDNN's matmul), fitted; None: compute_efficiency
    whole_step_compute_efficiency: float | None = Field(None, gt=0, le=1)
    # of peak_flops in attention's query-key products, which run kernels of their own (a CPU's paged-attention C
    # kernels: a tile of query rows against keys read in place, an exponential per score), fitted; None: the compute
    # efficiency of the step it is in
    attention_compute_efficiency: float | None = Field(None, gt=0, le=1)
    step_overhead_s: float = Field(ge=0)  # fitted: launches, scheduling not hidden behind the device
    per_sequence_s: float = Field(ge=0)  # fitted: host work per sequence in the step
    per_layer_launch_s: float = Field(0.0, ge=0)  # fitted: a layer's kernels started from the host
    replays_decode: bool = True  # decode-only steps run whole, with no launches per layer (CUDA graphs)
    # besides, any step of at most this many tokens runs whole (a CPU's fused C step, up to the rows of its linear
    # layers' small-step copies); None: every step; 0: none
    whole_step_tokens: int | None = Field(0, ge=0)
    launches_overlap: bool = True  # the device works while the host launches (GPUs); a CPU does one, then the other
    # the share of the shorter of a part's two times (its FLOPs', its bytes') hidden behind the longer: 1 the
    # roofline (GPUs), 0 their sum; a CPU's cores hide some of a small batch's arithmetic behind its weight reads
    memory_overlap: float = Field(1.0, ge=0, le=1)
    # the share of the reads of a KV block several of a step's sequences hold (a prefix cache hit) that the caches
    # serve after the first: 1 on a CPU, whose L2 holds a shared block's slice of a layer (measured: 8 decodes
    # sharing 256 tokens); 0, every sequence reading from memory, until a GPU's served steps with shared prefixes
    # say otherwise
    kv_cache_reuse: float = Field(0.0, ge=0, le=1)
    interconnect_bandwidth: float = Field(NVLINK_BANDWIDTH, gt=0)  # bytes/s per direction, for tensor parallelism
    allreduce_latency_s: float = Field(10e-6, ge=0)
    block_size: int = Field(16, ge=1)  # the engine's KV block on this device (16 on CUDA, 64 on CPU)
    dtype: str = "bfloat16"  # the engine's compute dtype on this device
    # measured / modelled time of the steps fitted on, each against the steps around it, over its mean, at every
    # percentile, where each step was timed alone (a served trace, the native engine's steps; not a grid's medians):
    # a simulated step's time is its modelled time times a draw from it (the host's step-to-step jitter; not its
    # speed over minutes, nor a shape the model misses), which leaves the expected time the fit's. None: each step
    # takes exactly its modelled time
    step_spread: list[float] | None = None
    source: ProfileSource

    @field_validator("step_spread")
    @classmethod
    def _percentiles(cls, spread: list[float] | None) -> list[float] | None:
        if spread is not None and (len(spread) != SPREAD_POINTS or spread[0] <= 0
                                   or any(b < a for a, b in itertools.pairwise(spread))):
            raise ValueError(f"step_spread is {SPREAD_POINTS} positive ratios, the percentiles 0-100 in order")
        return spread

    @model_validator(mode="before")
    @classmethod
    def _overlap_of_earlier_files(cls, data: Any) -> Any:
        """A profile saved before the overlap was a share said only yes (the roofline) or no (the sum)."""
        if isinstance(data, dict) and "overlaps_memory" in data and "memory_overlap" not in data:
            data = dict(data)
            data["memory_overlap"] = 1.0 if data.pop("overlaps_memory") else 0.0
        return data

    def runs_whole(self, tokens: int, decode_only: bool) -> bool:
        """Whether a step of ``tokens`` (``decode_only``: one a sequence) runs with no launches per layer."""
        return ((decode_only and self.replays_decode) or self.whole_step_tokens is None
                or tokens <= self.whole_step_tokens)

    def spread_factor(self, u: float) -> float:
        """The measured / modelled ratio at quantile ``u`` (0-1) of the step spread, interpolated; 1 without one."""
        if self.step_spread is None:
            return 1.0
        at = u * (SPREAD_POINTS - 1)
        i = min(int(at), SPREAD_POINTS - 2)
        return self.step_spread[i] + (self.step_spread[i + 1] - self.step_spread[i]) * (at - i)

    def save(self, path: Path | str) -> None:
        Path(path).write_text(json.dumps(self.model_dump(), indent=1) + "\n")


def profile_names() -> list[str]:
    """Profiles shipped in ``profiles/`` and GPU types a profile can be derived for."""
    return sorted({p.stem for p in PROFILES_DIR.glob("*.json")} | set(GPUS))


def load_profile(name: str) -> StepProfile:
    """A profile by file path, by name in ``profiles/``, or derived for a GPU type of ``gpus.GPUS``."""
    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        try:
            return StepProfile.model_validate_json(path.read_text())
        except ValidationError as exc:
            raise ValueError(f"{path} is not a device profile: {exc}") from None
    shipped = PROFILES_DIR / f"{name}.json"
    if shipped.exists():
        return StepProfile.model_validate_json(shipped.read_text())
    if name in GPUS:
        return derived_gpu_profile(name, load_profile(REFERENCE_GPU_PROFILE))
    raise ValueError(f"unknown profile {name!r}: a profile file, or one of {', '.join(profile_names())}")


def derived_gpu_profile(gpu_name: str, reference: StepProfile) -> StepProfile:
    """A GPU type nobody measured: its datasheet peaks with ``reference``'s fitted efficiencies and costs."""
    gpu = GPUS[gpu_name]
    fields: dict[str, Any] = reference.model_dump(exclude={"name", "device", "memory_bytes", "peak_flops",
                                                           "bandwidth", "interconnect_bandwidth", "source"})
    nvlink = gpu_name.startswith(("h", "a"))  # SXM parts; GeForce and L40S talk over PCIe
    return StepProfile(name=gpu_name, device=f"{gpu.name} (datasheet)", memory_bytes=int(gpu.memory_gib * 2**30),
                       peak_flops=gpu.bf16_tflops * 1e12, bandwidth=gpu.bandwidth_gbs * 1e9,
                       interconnect_bandwidth=NVLINK_BANDWIDTH if nvlink else PCIE_BANDWIDTH,
                       source=ProfileSource(how=f"datasheet peaks of {gpu.name}; efficiencies and per-step costs of "
                                                f"the {reference.name} profile, not measured on this GPU type"),
                       **fields)
