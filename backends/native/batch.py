"""The flat batch description: the only thing the scheduler hands to the model runner.

The scheduler fills a ``Batch`` with plain Python lists; the model runner's attention backend turns it
into tensors once per step (``AttentionBackend.build``). Sequences with a single query token
("decodes") always come first, longest context first.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == len(self.query_lens)
