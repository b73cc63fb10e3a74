"""The flat batch description: the only thing the scheduler hands to the model runner.

The scheduler fills a ``Batch`` with plain Python lists; the model runner's attention backend turns it
into tensors once per step (``AttentionBackend.build``). Sequences with a single query token
("decodes") always come first, longest context first.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


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
    # whether every query token of the sequence feeds the LM head (prompt logprobs), not only a sampled last
    all_logits: list[bool] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) KV blocks, first
    # async scheduling: (row of token_ids, index in the previous step's picks) of tokens not on the host yet
    placeholders: list[tuple[int, int]] = field(default_factory=list)
    admitted: int = 0  # sequences scheduled for the first time (not resumed after a preemption, nor a later chunk)

    def logits_rows(self) -> list[range]:
        """For each sequence, its rows in the step's logits (all its tokens, its last, or none)."""
        rows, r = [], 0
        for i, (n, sample) in enumerate(zip(self.query_lens, self.sample)):
            k = n if self.all_logits and self.all_logits[i] else int(sample)
            rows.append(range(r, r + k))
            r += k
        return rows

    def logits_indices(self) -> list[int]:
        """The flat token indices whose hidden states feed the LM head, in the order of ``logits_rows``."""
        out: list[int] = []
        start = 0
        for n, rows in zip(self.query_lens, self.logits_rows()):
            out.extend(range(start + n - len(rows), start + n))
            start += n
        return out

    def shared_kv_tokens(self, block_size: int) -> int:
        """Tokens of the KV blocks several of the step's sequences hold (prefix cache hits), counted past their
        first holder: attention reads such a block from memory once and from the cache for the others."""
        # The prefix cache shares a block only with every block before it: sequences that share any block share
        # their first, and most steps' sequences share none (a pass over first blocks, no table walked)
        holders: dict[int, list[tuple[list[int], int]]] = defaultdict(list)
        for table, context in zip(self.block_tables, self.context_lens):
            holders[table[0]].append((table, context))
        shared = 0
        for group in holders.values():
            if len(group) > 1:
                read = [table[:-(-context // block_size)] for table, context in group]
                shared += sum(map(len, read)) - len(set().union(*read))
        return shared * block_size

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
