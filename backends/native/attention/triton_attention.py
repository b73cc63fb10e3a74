"""Paged attention on CUDA: the Triton kernel of triton_kernels.py for every sequence of a step.

Also provides the static metadata that CUDA graphs of decode steps replay with: buffers allocated once
for the largest captured batch, refilled before each replay; rows past the real batch (padding) write
their key/value to a scratch block and attend to it alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.native.attention.base import AttentionBackend, StepMetadata, pad_tables
from backends.native.attention.triton_kernels import paged_attention
from backends.native.batch import Batch
from backends.native.transfers import to_device


@dataclass
class TritonMetadata(StepMetadata):
    block_tables: torch.Tensor  # [n, max_blocks] int32
    query_starts: torch.Tensor  # [n + 1] int32
    context_lens: torch.Tensor  # [n] int32
    max_query_len: int

    def rows(self, n: int) -> TritonMetadata:
        """The first ``n`` sequences of a decode-only metadata (one token each): views, no copies."""
        return TritonMetadata(self.slot_mapping[:n], self.logits_indices[:n], self.block_tables[:n],
                              self.query_starts[:n + 1], self.context_lens[:n], 1)


def supports(head_dim: int) -> bool:
    """The kernel loads whole heads as one power-of-two tile."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


class TritonAttention(AttentionBackend[TritonMetadata]):
    name = "Triton paged"
    supports_graphs = True

    def build(self, batch: Batch) -> TritonMetadata:
        starts, slots, logits_indices = self.common(batch)
        i32 = dict(dtype=torch.int32, device=self.device)
        return TritonMetadata(slots, logits_indices, to_device(pad_tables(batch.block_tables), **i32),
                              to_device([*starts, len(batch.token_ids)], **i32),
                              to_device(batch.context_lens, **i32), max(batch.query_lens))

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonMetadata, scale):
        return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_starts, meta.context_lens,
                               scale, meta.max_query_len)

    # ---------------------------------------------------------------------------------- CUDA graphs
    def static_decode_metadata(self, max_seqs: int, max_blocks: int) -> TritonMetadata:
        """Buffers for decode steps of up to ``max_seqs`` sequences, for graphs to capture."""
        i32 = dict(dtype=torch.int32, device=self.device)
        return TritonMetadata(
            slot_mapping=torch.full((max_seqs,), self.scratch_block * self.block_size, dtype=torch.int64,
                                    device=self.device),
            logits_indices=torch.arange(max_seqs, dtype=torch.int64, device=self.device),
            block_tables=torch.full((max_seqs, max_blocks), self.scratch_block, **i32),
            query_starts=torch.arange(max_seqs + 1, **i32),
            context_lens=torch.ones(max_seqs, **i32),
            max_query_len=1)

    def fill_decode_metadata(self, static: TritonMetadata, batch: Batch, size: int) -> None:
        """Write a decode-only ``batch`` into the first ``size`` rows of ``static``; rows past the batch
        become padding on the scratch block."""
        n, scratch_slot = len(batch.token_ids), self.scratch_block * self.block_size
        tables = pad_tables(batch.block_tables, self.scratch_block)
        width = len(tables[0])
        host = torch.tensor(tables, dtype=torch.int32)
        static.block_tables[:n, :width].copy_(host, non_blocking=True)
        static.block_tables[n:size, 0] = self.scratch_block
        lens = torch.tensor([*batch.context_lens, *[1] * (size - n)], dtype=torch.int32)
        static.context_lens[:size].copy_(lens, non_blocking=True)
        slots = torch.tensor([*batch.slot_mapping, *[scratch_slot] * (size - n)], dtype=torch.int64)
        static.slot_mapping[:size].copy_(slots, non_blocking=True)
