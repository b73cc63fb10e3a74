"""Model parallelism: which part of the model a rank holds, and how ranks talk.

Tensor parallelism (Megatron's): attention is split by heads: each rank holds ``num_heads / tp`` query heads and
the key/value heads they read (``num_kv_heads / tp`` of them, or, when there are fewer KV heads than ranks, the
one KV head its query heads share, replicated on ``tp / num_kv_heads`` ranks). The MLP is split by intermediate
columns. q/k/v and gate/up projections are column-parallel (a rank computes its own output columns); o_proj and
down_proj are row-parallel (each rank a partial sum, added by one all-reduce). The embedding table and the LM
head are split by vocabulary rows (padded to a multiple of tp): an embedding lookup is an all-reduce of each
rank's rows, and the logits of a step are gathered on the group's first rank, where sampling happens.

Pipeline parallelism (vLLM's): the layers are split into contiguous stages, the embedding with the first, the
norm and LM head with the last; each stage sends its hidden states and residual stream to the next, point to
point. Ranks are numbered as vLLM's, ``stage * tp + tp_rank``; each stage's ranks form a tensor-parallel group.
The engine's own process is the last stage's first rank (the driver): the logits are computed where they are
sampled and never cross a process boundary, and only the small hidden states do.

Tensors travel on the default process group (NCCL on CUDA, gloo on CPU); the driver's messages (each step's
batch, queries) on a gloo group beside it (vLLM's CPU group). One rank makes every collective a no-op, so
the single-process engine runs the same code.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from backends.native.config import EngineConfig, ModelConfig

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"  # vLLM's variable for uneven stages, e.g. "9,9,8,6"


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


def can_split(config: ModelConfig, size: int) -> bool:
    """Whether ``config`` can be split across ``size`` tensor-parallel ranks (``check_tensor_parallel`` says why not)."""
    try:
        check_tensor_parallel(config, size)
    except ValueError:
        return False
    return True


def stage_layers(num_layers: int, size: int, partition: list[int] | None = None) -> list[range]:
    """The layers of each of ``size`` pipeline stages: ``partition`` (layers per stage), else vLLM's
    ``VLLM_PP_LAYER_PARTITION``, else even shares with the remainder one each to the stages just before the
    last (the last also runs the norm and LM head). Raises ``ValueError`` naming what does not fit."""
    if partition is None and os.environ.get(PARTITION_ENV):
        try:
            partition = [int(n) for n in os.environ[PARTITION_ENV].split(",")]
        except ValueError:
            raise ValueError(f"{PARTITION_ENV}={os.environ[PARTITION_ENV]!r} is not a list of layer counts") from None
    if partition is None:
        if size > num_layers:
            raise ValueError(f"pipeline_parallel_size {size} is more than the model's {num_layers} layers")
        partition = [num_layers // size] * size
        for i in range(2, num_layers % size + 2):
            partition[-i] += 1
    if len(partition) != size:
        raise ValueError(f"pipeline_layer_partition {partition} has {len(partition)} stages, "
                         f"pipeline_parallel_size is {size}")
    if sum(partition) != num_layers or min(partition) < 1:
        raise ValueError(f"pipeline_layer_partition {partition} must give each stage at least one of the model's "
                         f"{num_layers} layers, {num_layers} in all")
    starts = [sum(partition[:i]) for i in range(size)]
    return [range(start, start + n) for start, n in zip(starts, partition)]


def check_parallel(config: EngineConfig, model: ModelConfig) -> None:
    """Raise ``ValueError`` naming the value when ``model`` cannot be split as ``config`` asks (before any rank
    starts)."""
    check_tensor_parallel(model, config.tensor_parallel_size)
    stage_layers(model.num_layers, config.pipeline_parallel_size, config.pipeline_layer_partition)


@dataclass
class TensorParallel:
    """One rank's place in its stage's tensor-parallel group (rank 0 of 1 when not parallel)."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, repr=False)  # None: the default group (every rank is in this group)

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
        """Sum ``x`` over the group's ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """The group's first rank: every rank's ``x`` [rows, n] side by side [rows, size * n]; others: None."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, group=self.group, group_dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


class Outbox:
    """Sends under way, with the tensors they read (which must live until they complete). A gloo send says it
    completed only once waited for, so the oldest are waited for beyond ``limit``: by then their receivers, which
    take messages in order, have long had them."""

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self.pending: deque[tuple[list[Any], list[torch.Tensor]]] = deque()

    def send(self, tensors: list[torch.Tensor], dst: int, group: Any = None) -> None:
        """Start sending ``tensors`` in order to global rank ``dst``; returns before the receiver has them (raises
        if an earlier send waited for failed: its receiver died)."""
        self.pending.append(([dist.isend(t, dst, group=group) for t in tensors], tensors))
        while len(self.pending) > self.limit:
            self._wait_oldest()

    def flush(self) -> None:
        """Wait for every send."""
        while self.pending:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        for work in self.pending.popleft()[0]:
            work.wait()


@dataclass
class StageClock:
    """Where a rank's time went since it started, for the pipeline's profile (``ModelRunner.stage_clock``)."""

    steps: int = 0
    step_s: float = 0.0  # inside its steps, waits for the previous stage included
    waiting_s: float = 0.0  # for the previous stage's hidden states (its work, the transfer, the bubble)
    sent_bytes: int = 0

    @property
    def busy_s(self) -> float:
        return self.step_s - self.waiting_s


@dataclass
class PipelineStage:
    """Which layers a rank's stage runs, and its neighbours in the pipeline (global ranks)."""

    index: int = 0
    count: int = 1
    layers: range = range(0)
    previous_rank: int | None = None  # the previous stage's rank of the same tensor-parallel rank
    next_rank: int | None = None
    outbox: Outbox = field(default_factory=Outbox, repr=False)
    clock: StageClock = field(default_factory=StageClock, repr=False)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def send(self, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Hand the hidden states and residual stream (zeros where the layers added it already: exact, since
        adding zeros changes no value) of this stage's rows to the next stage."""
        assert self.next_rank is not None, "the last stage sends nothing on"
        both = torch.stack([x, torch.zeros_like(x) if residual is None else residual])
        self.outbox.send([both.contiguous()], self.next_rank)
        self.clock.sent_bytes += both.numel() * both.element_size()

    def receive(self, rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's hidden states and residual stream of a step of ``rows`` tokens."""
        both = torch.empty(2, rows, hidden_size, dtype=dtype, device=device)
        started = time.perf_counter()
        dist.recv(both, self.previous_rank)
        self.clock.waiting_s += time.perf_counter() - started
        return both[0], both[1]


@dataclass
class Rank:
    """One process's place among ``tp x pp`` ranks: its tensor-parallel group and pipeline stage, and the
    driver's message channel (pickled objects on a gloo group)."""

    rank: int = 0
    size: int = 1
    driver: int = 0  # the engine's process: the last stage's first rank
    tp: TensorParallel = field(default_factory=TensorParallel)
    stage: PipelineStage = field(default_factory=PipelineStage)
    control: Any = field(default=None, repr=False)
    outbox: Outbox = field(default_factory=Outbox, repr=False)

    @classmethod
    def join(cls, rank: int, config: EngineConfig, layers: list[range], init_method: str, device: torch.device,
             timeout_s: float) -> Rank:
        """Join the process group of every rank at ``init_method`` (blocks until every rank has)."""
        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp_size * pp_size,
                                timeout=timeout)
        # every rank creates every group, in order; a worker waits on the control group for the next step as long as
        # the engine is idle (a dead peer is seen by its closed connection, not by this timeout)
        control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), timeout=timeout)
                  for s in range(pp_size)] if pp_size > 1 else [None]
        index, tp_rank = divmod(rank, tp_size)
        # up to pp batches in flight: as many hidden states on their way to the next stage, as many posts to each rank
        stage = PipelineStage(index, pp_size, layers[index], rank - tp_size if index > 0 else None,
                              rank + tp_size if index < pp_size - 1 else None, Outbox(limit=pp_size + 2))
        return cls(rank, tp_size * pp_size, (pp_size - 1) * tp_size, TensorParallel(tp_rank, tp_size, groups[index]),
                   stage, control, Outbox(limit=tp_size * pp_size * (pp_size + 2)))

    def leave(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    @property
    def is_driver(self) -> bool:
        return self.rank == self.driver

    # ------------------------------------------------------------------------ driver's messages
    def post(self, obj: Any, dst: int) -> None:
        """Send ``obj`` (pickled) to rank ``dst`` without waiting for it to be received."""
        self.post_all(obj, [dst])

    def post_all(self, obj: Any, ranks: list[int]) -> None:
        """Send ``obj``, pickled once, to every one of ``ranks`` without waiting for them to receive it."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for dst in ranks:
            self.outbox.send([size, data], dst, group=self.control)

    def receive_object(self, src: int) -> Any:
        """The next object rank ``src`` posted to this rank (waits for it)."""
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src, group=self.control)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, src, group=self.control)
        return pickle.loads(data.numpy().tobytes())

    def minimum(self, value: int) -> int:
        """The smallest of every rank's ``value`` (on every rank)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t)
