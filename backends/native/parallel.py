"""Megatron-style tensor parallelism: which slice of each weight a rank holds, and the collectives.

Attention is split by heads: each rank holds ``num_heads / tp`` query heads and the key/value heads they
read (``num_kv_heads / tp`` of them, or, when there are fewer KV heads than ranks, the one KV head its
query heads share, replicated on ``tp / num_kv_heads`` ranks). The MLP is split by intermediate columns.
q/k/v and gate/up projections are column-parallel (a rank computes its own output columns); o_proj and
down_proj are row-parallel (each rank a partial sum, added by one all-reduce). The embedding table and
the LM head are split by vocabulary rows (padded to a multiple of tp): an embedding lookup is an
all-reduce of each rank's rows, and the logits of a step are gathered on rank 0, where sampling happens.

Tensors travel on the default process group (NCCL on CUDA, gloo on CPU); each step's batch and other
Python objects on a gloo group beside it (vLLM's CPU group). ``tp.size == 1`` makes every collective a
no-op, so the single-device engine runs the same code.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from backends.native.config import ModelConfig


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming the value when ``config`` cannot be split across ``size`` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if config.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {config.num_heads} attention heads")
    if config.num_kv_heads % size and size % config.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} neither divides nor is a multiple of the model's "
                         f"{config.num_kv_heads} key/value heads")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's intermediate size "
                         f"{config.intermediate_size}")


@dataclass
class TensorParallel:
    """One rank's place in a tensor-parallel group (rank 0 of 1 when not parallel)."""

    rank: int = 0
    size: int = 1
    cpu_group: Any = field(default=None, repr=False)  # gloo group for Python objects

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, device: torch.device, timeout_s: float) -> TensorParallel:
        """Join the process group of ``size`` ranks at ``init_method`` (blocks until every rank has)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        return cls(rank, size, cpu_group)

    def leave(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    # ---------------------------------------------------------------------------------- shards
    def rows(self, total: int) -> slice:
        """This rank's even share of ``total`` rows (``total`` divisible by ``size``)."""
        share = total // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def padded_rows(self, total: int) -> slice:
        """This rank's share of ``total`` rows padded to a multiple of ``size`` (vocabulary splits)."""
        share = -(-total // self.size)
        return slice(self.rank * share, (self.rank + 1) * share)

    def kv_heads(self, num_kv_heads: int) -> slice:
        """The key/value heads this rank holds: its share, or the one its query heads read."""
        if num_kv_heads >= self.size:
            return self.rows(num_kv_heads)
        head = self.rank // (self.size // num_kv_heads)
        return slice(head, head + 1)

    # ------------------------------------------------------------------------------ collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``x`` [rows, n] side by side [rows, size * n]; other ranks: None."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled, on the gloo group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Rank 0: every rank's ``obj`` in rank order; other ranks: None."""
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    def minimum(self, value: int) -> int:
        """The smallest of every rank's ``value`` (on every rank)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)
