"""The flat batch description: the only thing the scheduler hands to the model runner.

The scheduler side fills a ``Batch`` with plain Python lists; ``AttentionMetadata.build`` turns it into
tensors once per step, and both attention paths (CPU torch, CUDA Triton) read the same metadata.
Sequences with a single query token ("decodes") always come first.
"""

from __future__ import annotations

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
class AttentionMetadata:
    """Tensor form of a ``Batch``, shared by every layer of one forward pass."""

    slot_mapping: torch.Tensor  # [T] int64
    block_size: int
    num_blocks: int
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with block 0
    decode_context_lens: torch.Tensor  # [num_decodes] int64
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool, True = attend
    query_starts: list[int]  # flat start of each sequence's queries
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor]  # per sequence, int64
    logits_indices: torch.Tensor  # [num_sampled] flat rows whose hidden state feeds the LM head

    @classmethod
    def build(cls, batch: Batch, block_size: int, num_blocks: int, device: torch.device) -> AttentionMetadata:
        nd = batch.num_decodes
        starts, acc = [], 0
        for q in batch.query_lens:
            starts.append(acc)
            acc += q
        logits_indices = [s + q - 1 for s, q, smp in zip(starts, batch.query_lens, batch.sample) if smp]

        def i64(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        decode_tables = batch.block_tables[:nd]
        max_blocks = max((len(t) for t in decode_tables), default=0)
        # Pad with block 0: padded positions are masked out, so any valid block index will do.
        padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
        decode_ctx = i64(batch.context_lens[:nd])
        decode_mask = None
        if nd:
            span = torch.arange(max_blocks * block_size, device=device)
            decode_mask = (span[None, :] < decode_ctx[:, None])[:, None, None, :]
        return cls(
            slot_mapping=i64(batch.slot_mapping),
            block_size=block_size,
            num_blocks=num_blocks,
            num_decodes=nd,
            decode_block_tables=i64(padded).reshape(nd, max_blocks),
            decode_context_lens=decode_ctx,
            decode_mask=decode_mask,
            query_starts=starts,
            query_lens=list(batch.query_lens),
            context_lens=list(batch.context_lens),
            block_tables=[i64(t) for t in batch.block_tables],
            logits_indices=i64(logits_indices),
        )
