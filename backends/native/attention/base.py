"""What every attention path shares: the step metadata the model reads, and the backend contract.

An attention backend turns the scheduler's flat ``Batch`` into its own metadata once per step
(``build``) and runs paged attention for every layer (``forward``): prefill chunks and decodes of one
step together, their new keys and values already stored in the cache by the layer ops. The model sees
only ``slot_mapping`` (where this step's keys/values go) and ``logits_indices`` (which rows feed the LM
head); everything else belongs to the backend that built it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from backends.native.batch import Batch
from backends.native.transfers import to_device


@dataclass
class StepMetadata:
    """Per-step tensors every layer reads; backends subclass it with their own fields."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot each token's key/value is stored at
    logits_indices: torch.Tensor  # [num_sampled] int64: rows whose hidden state feeds the LM head


Meta = TypeVar("Meta", bound=StepMetadata)


class AttentionBackend(abc.ABC, Generic[Meta]):
    """One way of running paged attention (pure torch, C kernels on CPU, Triton on CUDA), on metadata of its own
    (``Meta``)."""

    name: str
    supports_graphs = False  # builds static decode metadata that CUDA graphs can replay (cuda_graphs.py)

    def __init__(self, block_size: int, num_blocks: int, device: torch.device) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device

    @abc.abstractmethod
    def build(self, batch: Batch) -> Meta:
        """The tensors this backend's ``forward`` needs for ``batch``, built once per step."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: Meta, scale: float) -> torch.Tensor:
        """Attention output [T, Hq, D] for queries ``q`` [T, Hq, D]. This step's keys/values ``k``/``v``
        [T, Hkv, D] are already in the caches [Hkv, num_blocks, block_size, D] (head-major)."""

    def static_decode_metadata(self, max_seqs: int, max_blocks: int) -> Meta:
        """Decode metadata of fixed addresses for up to ``max_seqs`` sequences of ``max_blocks`` blocks, which
        captured CUDA graphs read (``supports_graphs`` backends only)."""
        raise NotImplementedError(f"{self.name} attention runs no CUDA graphs")

    def fill_decode_metadata(self, static: Meta, batch: Batch, size: int) -> None:
        """Write a decode ``batch`` padded to ``size`` sequences into ``static`` in place (``supports_graphs``
        backends only)."""
        raise NotImplementedError(f"{self.name} attention runs no CUDA graphs")

    @property
    def scratch_block(self) -> int:
        """One block past those the block manager hands out (the caches hold it): padding rows write there."""
        return self.num_blocks

    def pad(self, meta: Meta, rows: int, logits_rows: int) -> None:
        """Extend ``meta`` to a step padded to ``rows`` token rows, whose extra keys and values go to the
        scratch block, and to ``logits_rows`` LM-head rows (repeats of row 0, for the caller to drop). The
        backend's own fields still describe the real sequences only: padding rows are never attended."""
        slots, indices = meta.slot_mapping, meta.logits_indices
        meta.slot_mapping = torch.cat([slots, slots.new_full((rows - len(slots),), self.scratch_block * self.block_size)])
        meta.logits_indices = torch.cat([indices, indices.new_zeros(logits_rows - len(indices))])

    def int64(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)

    def common(self, batch: Batch) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(flat start of each sequence's queries, slot mapping, logits indices) of ``batch``."""
        starts, acc = [], 0
        for n in batch.query_lens:
            starts.append(acc)
            acc += n
        return starts, self.int64(batch.slot_mapping), self.int64(batch.logits_indices())


def pad_tables(tables: list[list[int]], fill: int = 0) -> list[list[int]]:
    """Block tables padded to the longest with ``fill`` (never read: context lengths bound every kernel)."""
    width = max((len(t) for t in tables), default=0)
    return [t + [fill] * (width - len(t)) for t in tables]
