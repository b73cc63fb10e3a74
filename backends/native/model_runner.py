"""Owns the model weights and the KV cache tensors; runs one flat batch. Makes no policy decisions.

Start-up (after the process's own settings, process.py): build the model on its device, fill
it (checkpoint or random weights), pick its kernels, size the KV cache (a byte budget, or on CUDA what
``gpu_memory_utilization`` leaves after a profiled step at the full token budget, as vLLM does), allocate
it, and on CUDA capture decode steps as graphs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Protocol

import torch

from backends.native.attention import Kernels, choose_kernels
from backends.native.batch import Batch
from backends.native.config import EngineConfig, ModelConfig
from backends.native.cuda_graphs import DecodeGraphs
from backends.native.fused_step import FusedStep
from backends.native.linear import Linear
from backends.native.model import LlamaModel, dummy_tensors
from backends.native.parallel import PipelineStage, Rank, TensorParallel
from backends.native.rotary import RotaryEmbedding
from backends.native.row_buckets import padded_rows, warm_up_linears
from backends.native.transfers import to_device
from backends.native.weights import Checkpoint

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 2 << 30  # the default budget where memory cannot be profiled


def build_model(config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                rank: Rank | None = None, int8: bool = False) -> LlamaModel:
    """An uninitialised model (this rank's shard of its stage) on ``device``, with int8 linear layers if ``int8``;
    ``load_weights`` or the caller fills it."""
    rank = rank or Rank(stage=PipelineStage(layers=range(config.num_layers)))
    with torch.device("meta"):
        model = LlamaModel(config, max_positions, rank.tp, rank.stage)
        if int8:
            model.to_int8()  # before memory is allocated: a float copy of the weights never exists
    model = model.to_empty(device=device)
    model.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling, device)
    if model.head_is_table and not int8:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype=dtype).eval().requires_grad_(False)


def local_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The head layout one of ``tp_size`` ranks computes (what its kernels and KV cache see)."""
    kv = TensorParallel(0, tp_size).kv_heads(config.num_kv_heads)
    return dataclasses.replace(config, num_heads=config.num_heads // tp_size, num_kv_heads=kv.stop - kv.start)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1,
                       num_layers: int | None = None) -> int:
    """Keys and values of ``block_size`` tokens across ``num_layers`` layers (default: all: one pipeline stage),
    on one of ``tp_size`` ranks."""
    local = local_config(config, tp_size)
    layers = config.num_layers if num_layers is None else num_layers
    return 2 * layers * block_size * local.num_kv_heads * config.head_dim * dtype.itemsize


def kv_cache_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int,
                    tp_size: int = 1, num_layers: int | None = None) -> int:
    """How many KV blocks a rank's ``budget_bytes`` hold: the engine's allocation and the planner's prediction."""
    return max(budget_bytes, 0) // kv_bytes_per_block(config, block_size, dtype, tp_size, num_layers)


class StepRunner(Protocol):
    """What the engine runs its steps on: ``ModelRunner`` (one process), ``ParallelRunner`` (workers.py: ranks in
    processes or Ray actors; it alone runs ``depth`` > 1 steps at once, by ``launch`` and ``finish``) or
    backends/sim's ``SimulatedRunner`` (modelled step times, no weights: ``picks_tokens``)."""

    picks_tokens: bool  # execute returns the tokens themselves, not logits for the engine's sampler
    depth: int  # batches in flight at once
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    block_size: int
    num_blocks: int
    num_layers: int
    kernels: Any  # describe() names them
    graphs: Any  # CUDA graphs, or None
    fused: Any  # fused CPU steps, or None

    @property
    def alive(self) -> bool: ...

    @property
    def kv_medium(self) -> str:
        """Where the KV cache lives, as vLLM's KV events name it ("GPU", "CPU")."""

    def execute(self, batch: Batch) -> Any: ...

    def weight_bytes(self) -> int: ...

    def small_step_copy_bytes(self) -> int: ...

    def linear_kernels(self) -> dict[str, str]: ...

    def close(self) -> None: ...


class ModelRunner:
    picks_tokens = False  # execute returns logits for the engine's sampler (backends/sim's runner: tokens)
    depth = 1  # batches in flight at once: one process runs one step at a time

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int,
                 rank: Rank | None = None, device: torch.device | None = None) -> None:
        """One rank's runner (the whole model without ``rank``); ``device`` overrides ``config.device``."""
        self.rank = rank or Rank(stage=PipelineStage(layers=range(checkpoint.config.num_layers)))
        self.tp, self.stage = self.rank.tp, self.rank.stage
        self.device = device or config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        if config.quantization == "int8" and self.device.type != "cpu":
            raise ValueError(f"quantization int8 runs on CPU only (torch's int8 weight kernel); device is {self.device}")
        self.kv_dtype = config.torch_kv_cache_dtype(self.dtype)
        if self.kv_dtype != self.dtype and self.device.type != "cpu":
            raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype} runs on CPU only (the CUDA kernels read caches "
                             f"stored as the model's dtype); device is {self.device}")
        self.block_size = config.kv_block_size(self.device)
        self.max_model_len = max_model_len
        self.model = self._load(config, checkpoint)
        # Every rank must hold the same number of blocks: the block manager on rank 0 hands them out.
        self.num_blocks = self.rank.minimum(config.num_blocks or self._fit_blocks(config))
        if self.num_blocks < 1:
            raise ValueError("no memory is left for the KV cache: lower max_num_batched_tokens or raise "
                             "gpu_memory_utilization / kv_cache_gb")
        self.kernels: Kernels = choose_kernels(config.kernels, local_config(self.model.config, self.tp.size),
                                               self.dtype, self.device, self.block_size, self.num_blocks)
        self.model.use_kernels(self.kernels)
        self.model.pack_linear_weights()
        # oneDNN compiles a kernel per row count of a packed matmul: steps are padded to a few (row_buckets.py).
        # The tile kernels that serve bf16 weights on AMX take any row count: a model without packed weights
        # pads nothing.
        self.pad_rows = any(m.kernel.compiles_per_shape for m in self.model.modules() if isinstance(m, Linear))
        if self.pad_rows and config.warmup:
            warm_up_linears(self.model, self.dtype, config.max_num_batched_tokens, config.max_num_seqs)
        self.num_layers = len(self.model.layers)  # this rank's stage's
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.graphs = None  # a graph replays the whole model: one pipeline stage only
        if (self.device.type == "cuda" and not config.enforce_eager and self.kernels.attention.supports_graphs
                and self.stage.count == 1):
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.kernels.attention, config.max_num_seqs,
                                       -(-max_model_len // self.block_size))
        self.fused = None if config.enforce_eager else FusedStep.build(self.model, self.kv_caches, self.kernels)

    def _load(self, config: EngineConfig, checkpoint: Checkpoint) -> LlamaModel:
        int8 = config.quantization == "int8"
        if config.load_format == "dummy":
            model = build_model(checkpoint.config, self.max_model_len, self.dtype, self.device, self.rank, int8)
            model.load_weights(dummy_tensors(checkpoint.config, config.seed, self.dtype, self.device))
            return model
        # Filled in fp32 where it runs, then cast: GGUF tensors arrive dequantised to fp32 (Q8_0 ones as stored).
        model = build_model(checkpoint.config, self.max_model_len, torch.float32, self.device, self.rank, int8)
        model.load_weights(checkpoint.tensors(model.holds))
        return model.to(dtype=self.dtype)

    # ---------------------------------------------------------------------------------- KV cache
    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = local_config(self.model.config, self.tp.size)
        # One block more than the block manager hands out: padding rows of CUDA graphs write there.
        shape = (cfg.num_kv_heads, num_blocks + 1, self.block_size, cfg.head_dim)  # head-major: see attention/
        return [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                 torch.zeros(shape, dtype=self.kv_dtype, device=self.device)) for _ in self.model.layers]

    def _fit_blocks(self, config: EngineConfig) -> int:
        cfg, tp_size, layers = self.model.config, self.tp.size, len(self.model.layers)
        if config.kv_cache_gb is not None or self.device.type != "cuda":
            budget = int(config.kv_cache_gb * 2**30) if config.kv_cache_gb is not None else CPU_KV_CACHE_BYTES
            return kv_cache_blocks(cfg, self.block_size, self.kv_dtype, budget, tp_size, layers)
        free, total = self._profile(config)
        budget = int(total * config.gpu_memory_utilization) - (total - free)
        log.info("KV cache: %.2f GiB of %.2f GiB (gpu_memory_utilization %.2f; %.2f GiB used by weights, "
                 "peak activations and others)", max(budget, 0) / 2**30, total / 2**30,
                 config.gpu_memory_utilization, (total - free) / 2**30)
        return kv_cache_blocks(cfg, self.block_size, self.kv_dtype, budget, tp_size, layers)

    def _profile(self, config: EngineConfig) -> tuple[int, int]:
        """(free, total) GPU bytes as they would be at the peak of a step at the full token budget."""
        tokens = min(config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-tokens // self.block_size)
        kernels = choose_kernels("torch", local_config(self.model.config, self.tp.size), self.dtype, self.device,
                                 self.block_size, blocks)
        self.model.use_kernels(kernels)
        caches = self._allocate_kv_cache(blocks)
        batch = Batch([0] * tokens, list(range(tokens)), list(range(tokens)), [tokens], [tokens],
                      [list(range(blocks))], [True])
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        hidden = None if self.stage.is_first else self._zeros_hidden(tokens)
        with torch.inference_mode():
            self.model(self._ids(batch.token_ids), self._ids(batch.positions), caches, kernels.attention.build(batch),
                       hidden)
        torch.cuda.synchronize(self.device)
        # What torch's allocator held at the peak, beyond what it holds now, is taken again by every big step.
        transient = torch.cuda.max_memory_reserved(self.device) - torch.cuda.memory_reserved(self.device)
        del caches
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return free - transient, total

    # ------------------------------------------------------------------------------------- figures
    alive = True  # a single process: as alive as its caller

    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds."""
        return self.model.weight_bytes()

    def linear_kernels(self) -> dict[str, str]:
        """This rank's kernel per kind of linear layer (``LlamaModel.linear_kernels``)."""
        return self.model.linear_kernels()

    @property
    def kv_medium(self) -> str:
        """Where this rank's KV cache lives, as vLLM's KV events name it."""
        return "GPU" if self.device.type == "cuda" else "CPU"

    def stage_clock(self) -> dict:
        """Where this rank's time went (parallel.StageClock), with its busy time."""
        clock = self.stage.clock
        return {**dataclasses.asdict(clock), "busy_s": clock.busy_s}

    def small_step_copy_bytes(self) -> int:
        """Bytes of this rank's small-step copies of linear weights, tiles or strips (within ``weight_bytes``)."""
        return self.model.small_step_copy_bytes()

    def close(self) -> None:
        """Nothing to release beyond memory (the tensor-parallel runner stops its workers here)."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source → destination) in every layer: copy-on-write of shared blocks."""
        src = self._ids([s for s, _ in copies])
        dst = self._ids([d for _, d in copies])
        for k_cache, v_cache in self.kv_caches:  # [Hkv, blocks, block_size, D]
            k_cache[:, dst] = k_cache[:, src]
            v_cache[:, dst] = v_cache[:, src]

    # --------------------------------------------------------------------------------------- step
    def _zeros_hidden(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(rows, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        return x, torch.zeros_like(x)

    def _stage_input(self, real_rows: int, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The previous stage's output for this step (None on the first stage), padded to ``rows``."""
        if self.stage.is_first:
            return None
        x, residual = self.stage.receive(real_rows, self.model.config.hidden_size, self.dtype, self.device)
        if rows > real_rows:
            pad = self._zeros_hidden(rows - real_rows)
            x, residual = torch.cat([x, pad[0]]), torch.cat([residual, pad[1]])
        return x, residual

    def _ids(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)

    def _token_ids(self, batch: Batch, values: list[int], previous: torch.Tensor | None) -> torch.Tensor:
        """``values`` (the batch's token ids, maybe padded) on the device, with the picks of the step before
        that the host has not seen yet written in: ``batch.placeholders`` are (row, index into ``previous``)."""
        ids = self._ids(values)
        if batch.placeholders:
            assert previous is not None, "placeholders stand for the previous step's picks"
            rows, picks = zip(*batch.placeholders)
            ids[self._ids(list(rows))] = previous[self._ids(list(picks))]
        return ids

    @torch.inference_mode()
    def execute(self, batch: Batch, previous: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run one step of this rank's stage; returns fp32 logits [rows, vocab], the rows of
        ``batch.logits_rows()``, on the last stage's first rank (None on other ranks: an earlier stage sends its
        hidden states on). ``previous``: the token picks of the step before, on the device, where
        ``batch.placeholders`` takes tokens from (async scheduling)."""
        started = time.perf_counter()
        try:
            return self._execute(batch, previous)
        finally:
            self.stage.clock.steps += 1
            self.stage.clock.step_s += time.perf_counter() - started

    def _execute(self, batch: Batch, previous: torch.Tensor | None) -> torch.Tensor | None:
        if batch.block_copies:
            self.copy_blocks(batch.block_copies)
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch, self._token_ids(batch, batch.token_ids, previous))
        attention = self.kernels.attention
        meta = attention.build(batch)
        fused = self.fused if self.fused is not None and self.fused.can_run(batch) else None
        ids, positions, logits_rows = batch.token_ids, batch.positions, len(meta.logits_indices)
        if self.pad_rows:  # a fused step's kernels take any row count: only its LM head's rows are bucketed
            padding = [] if fused is not None else [0] * (padded_rows(len(ids)) - len(ids))
            ids, positions = ids + padding, positions + padding
            attention.pad(meta, len(ids), padded_rows(logits_rows))
        hidden = self._stage_input(len(batch.token_ids), len(ids))
        ids, positions = self._token_ids(batch, ids, previous), self._ids(positions)
        if fused is not None:
            return fused.run(ids, positions, meta)[:logits_rows]
        out = self.model(ids, positions, self.kv_caches, meta, hidden)
        if not self.stage.is_last:
            x, residual = out
            rows = len(batch.token_ids)
            self.stage.send(x[:rows], None if residual is None else residual[:rows])
            return None
        return out if out is None else out[:logits_rows]
