"""The model runner of a simulated replica: it computes nothing, picks filler tokens, and takes the step-time
model's seconds for each step (times a seeded draw from the profile's measured step spread, where it has one), so
that the native engine's own scheduler and block manager (continuous batching, chunked prefill, the prefix cache
with eviction, preemption) run as they would on the device the profile describes, without the device.

In real time (served replicas) ``execute`` returns when the modelled step would have ended. The host's work
between steps overlaps the device's step as async scheduling makes it on a GPU: a step starts when the
previous one ended if the host was done within the previous step's time, else when the host is done. In
virtual time the caller advances its own clock by ``last_step_s``."""

from __future__ import annotations

import itertools
import random
import time

import torch

from backends.base import SamplingParams
from backends.native.config import EngineConfig, ModelConfig, torch_dtype_named
from backends.native.model_runner import CPU_KV_CACHE_BYTES, kv_cache_blocks
from backends.native.planner import gpu_kv_budget_bytes, weight_bytes_per_gpu
from backends.sim.profile import StepProfile, load_profile
from backends.sim.step_time import StepCost, StepTimeModel
from backends.tokenizer import Tokenizer

FILLER = (" The quick brown fox jumps over the lazy dog while the band plays on, and every listener in the hall"
          " keeps time with the drums.")


def unsupported_by_simulation(params: SamplingParams) -> str | None:
    """The request field a simulated replica cannot honour (it has no logits), if any."""
    if params.logprobs is not None:
        return "logprobs"
    if params.prompt_logprobs is not None:
        return "prompt_logprobs"
    if params.structured is not None:
        return "response_format"
    if params.logit_bias:
        return "logit_bias"
    if params.n > 1:
        return "n"
    return None


class _Kernels:
    def __init__(self, profile: StepProfile) -> None:
        self.profile = profile

    def describe(self) -> str:
        return f"simulated: {self.profile.name} ({self.profile.device})"


class SimulatedRunner:
    """``ModelRunner``'s interface to the engine, with no model: ``execute`` returns the sampled rows' tokens."""

    picks_tokens = True  # the engine takes its tokens as they are: there are no logits to sample from
    depth = 1  # batches in flight at once: one process runs one step at a time
    graphs = fused = None
    alive = True

    def __init__(self, config: EngineConfig, model: ModelConfig, tokenizer: Tokenizer, eos_token_ids: frozenset[int]) -> None:
        simulation = config.simulate
        assert simulation is not None
        self.profile = profile = load_profile(simulation.profile)
        self.real_time = simulation.real_time
        self.device = torch.device("cpu")  # the host runs the whole step: no async scheduling to overlap
        self.dtype = torch_dtype_named(profile.dtype if config.dtype == "auto" else config.dtype)
        self.kv_dtype = config.torch_kv_cache_dtype(self.dtype)
        self.block_size = config.block_size or profile.block_size
        self.num_layers = model.num_layers  # every layer: a simulated replica runs no pipeline stages
        tp = config.tensor_parallel_size
        self.cost = StepCost.of(model, self.dtype.itemsize, self.kv_dtype.itemsize, tp)
        self.step_time = StepTimeModel(profile, self.cost)
        self._weight_bytes = weight_bytes_per_gpu(model, self.dtype, tp)
        self.num_blocks = config.num_blocks or kv_cache_blocks(model, self.block_size, self.kv_dtype,
                                                               self._kv_budget(config, model, tp), tp)
        self.kernels = _Kernels(profile)
        self.kv_medium = "CPU" if profile.memory_bytes is None else "GPU"  # where its KV events say blocks are
        filler = [t for t in tokenizer.encode(FILLER) if t not in eos_token_ids and t < model.vocab_size]
        self._tokens = itertools.cycle(filler or [0])
        self._draws = random.Random(simulation.seed) if simulation.spread and profile.step_spread else None  # of the spread
        self.last_step_s = 0.0
        self._free_at = 0.0  # real time: when the device finishes the step in flight (time.monotonic)
        self._previous_s = 0.0  # real time: the modelled seconds of that step

    def _kv_budget(self, config: EngineConfig, model: ModelConfig, tp: int) -> int:
        if config.kv_cache_gb is not None:
            return int(config.kv_cache_gb * 2**30)
        if self.profile.memory_bytes is None:  # a CPU: the engine's default budget there
            return CPU_KV_CACHE_BYTES
        return gpu_kv_budget_bytes(model, self.profile.memory_bytes, self.dtype, tp, config.gpu_memory_utilization,
                                   config.max_num_batched_tokens, config.max_num_seqs)

    def execute(self, batch, previous=None) -> list[int]:
        """The step's modelled seconds in ``last_step_s`` (slept in real time), drawn from the profile's step spread
        where it has one; one filler token per sampled row."""
        rows = sum(batch.sample)
        # blocks the step's sequences share matter only where the caches serve some of their reads
        shared = batch.shared_kv_tokens(self.block_size) if self.profile.kv_cache_reuse else 0
        self.last_step_s = self.step_time.seconds(batch.query_lens, batch.context_lens, rows, shared)
        if self._draws is not None:
            self.last_step_s *= self.profile.spread_factor(self._draws.random())
        if self.real_time:
            self._pace(self.last_step_s)
        return [next(self._tokens) for _ in range(rows)]

    def _pace(self, seconds: float) -> None:
        now = time.monotonic()
        # The host's work since the previous step ended ran beside it if it took no longer than that step.
        start = self._free_at if now - self._free_at <= self._previous_s else now
        self._free_at, self._previous_s = start + seconds, seconds
        if (wait := self._free_at - time.monotonic()) > 0:
            time.sleep(wait)

    def weight_bytes(self) -> int:
        return self._weight_bytes

    def small_step_copy_bytes(self) -> int:
        return 0

    def linear_kernels(self) -> dict[str, str]:
        return {}  # no layers run: each step takes the time the profile models

    def close(self) -> None:
        pass
