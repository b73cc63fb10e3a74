"""The flat batch description: the only thing the scheduler hands to the model runner.

The scheduler side fills a ``Batch`` with plain Python lists; ``AttentionMetadata.build`` turns it into
tensors once per step, and the attention code reads only that metadata.
Sequences with a single query token ("decodes") always come first, longest context first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One engine step. Per-sequence lists are parallel; per-token lists are flat over the batch."""

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]  # flat KV slot (block_id * block_size + offset) each token writes to
    query_lens: list[int]  # new tokens per sequence this step
    context_lens: list[int]  # tokens in the KV cache per sequence after this step (prefix + new)
    block_tables: list[list[int]]
    sample: list[bool]  # whether the sequence's last token this step produces a next token

    @property
    def num_decodes(self) -> int:
        """Leading sequences with exactly one query token."""
        n = 0
        for q in self.query_lens:
            if q != 1:
                break
            n += 1
        return n


@dataclass
class DecodeGroup:
    """Decodes ``start:end`` of similar context length, padded to the longest of them."""

    start: int
    end: int
    block_tables: torch.Tensor  # [n, max_blocks] int64, padded with block 0 (masked out)
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool, True = attend


# Padding every decode to the batch's longest context wastes up to half of the gather and attention
# work; a new group starts when a context is this much shorter than its group's longest.
GROUP_SHRINK = 0.7


class Workspace:
    """Scratch memory reused by every layer and step: gathering into fresh large allocations page-faults
    (measured 4x slower than into reused memory on CPU)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def tensors(self, shape: tuple[int, ...], count: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """``count`` tensors of ``shape``, valid until the next call."""
        numel = math.prod(shape)
        buf = self._buf
        if buf is None or buf.numel() < numel * count or buf.dtype != dtype or buf.device != device:
            buf = self._buf = torch.empty(int(numel * count * 1.25) + 1, dtype=dtype, device=device)
        return [buf[i * numel:(i + 1) * numel].view(shape) for i in range(count)]


@dataclass
class AttentionMetadata:
    """Tensor form of a ``Batch``, shared by every layer of one forward pass."""

    slot_mapping: torch.Tensor  # [T] int64
    block_size: int
    num_blocks: int
    num_decodes: int
    decode_groups: list[DecodeGroup]  # decodes bucketed by context length
    query_starts: list[int]  # flat start of each sequence's queries
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor]  # per sequence, int64
    logits_indices: torch.Tensor  # [num_sampled] flat rows whose hidden state feeds the LM head
    workspace: Workspace
    # Paged decode kernels only (C on CPU, Triton on CUDA): every decode's block table padded to one
    # width, and its context length; ``decode_groups`` is then empty.
    decode_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    # Paged prefill kernel only (C on CPU): the same for the prefill chunks, with each chunk's first row
    # (counted from the first prefill token) and length; ``block_tables`` is then empty.
    prefill_tables: torch.Tensor | None = None
    prefill_query_starts: torch.Tensor | None = None
    prefill_query_lens: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None

    @classmethod
    def build(cls, batch: Batch, block_size: int, num_blocks: int, device: torch.device,
              workspace: Workspace | None = None, paged_decode: bool = False,
              paged_prefill: bool = False) -> AttentionMetadata:
        """``paged_decode`` / ``paged_prefill``: those sequences go to kernels that read the cache in place."""
        nd = batch.num_decodes
        starts, acc = [], 0
        for q in batch.query_lens:
            starts.append(acc)
            acc += q
        logits_indices = [s + q - 1 for s, q, smp in zip(starts, batch.query_lens, batch.sample) if smp]

        def i64(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        tables, ctx = batch.block_tables[:nd], batch.context_lens[:nd]
        kernel = paged_decode and nd > 0
        prefill_kernel = paged_prefill and nd < len(batch.query_lens)
        groups = [] if kernel else [
            DecodeGroup(a, b, i64(_pad(tables[a:b])), _mask(ctx[a:b], len(tables[a]) * block_size, device))
            for a, b in _similar_runs([len(t) for t in tables])]
        return cls(
            slot_mapping=i64(batch.slot_mapping),
            block_size=block_size,
            num_blocks=num_blocks,
            num_decodes=nd,
            decode_groups=groups,
            query_starts=starts,
            query_lens=list(batch.query_lens),
            context_lens=list(batch.context_lens),
            block_tables=[] if prefill_kernel else [i64(t) for t in batch.block_tables],
            logits_indices=i64(logits_indices),
            workspace=workspace or Workspace(),
            decode_tables=i64(_pad(tables)) if kernel else None,
            decode_context_lens=i64(ctx) if kernel else None,
            prefill_tables=i64(_pad(batch.block_tables[nd:])) if prefill_kernel else None,
            prefill_query_starts=i64([start - nd for start in starts[nd:]]) if prefill_kernel else None,
            prefill_query_lens=i64(batch.query_lens[nd:]) if prefill_kernel else None,
            prefill_context_lens=i64(batch.context_lens[nd:]) if prefill_kernel else None,
        )


def _pad(tables: list[list[int]]) -> list[list[int]]:
    width = max((len(t) for t in tables), default=0)
    return [t + [0] * (width - len(t)) for t in tables]


def _mask(context_lens: list[int], width: int, device: torch.device) -> torch.Tensor:
    span = torch.arange(width, device=device)
    return (span[None, :] < torch.tensor(context_lens, device=device)[:, None])[:, None, None, :]


def _similar_runs(lengths: list[int]) -> list[tuple[int, int]]:
    """Split a non-increasing list into runs whose members are at least GROUP_SHRINK of the run's first."""
    runs, start = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] < GROUP_SHRINK * lengths[start]:
            runs.append((start, i))
            start = i
    return runs
