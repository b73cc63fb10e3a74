"""The batch a step hands the model runner, and what it says about the step's reads (backends/native/batch.py)."""

from __future__ import annotations

import pytest

from backends.native.batch import Batch


def _decodes(block_tables: list[list[int]], context_lens: list[int]) -> Batch:
    n = len(block_tables)
    return Batch([], [], [], [1] * n, context_lens, block_tables, [True] * n)


@pytest.mark.parametrize("tables, contexts, shared", [
    ([[1, 2, 3], [4, 5, 6]], [130, 140], 0),  # nothing cached in common
    ([[1, 2, 3], [1, 2, 4], [1, 9]], [130, 140, 100], (2 + 1) * 64),  # block 1 held by three, block 2 by two
    ([[1, 2, 3], [1, 2]], [130, 64], 64),  # the second reads only its first block: the one in its context
    ([[7, 8]] * 4, [128] * 4, 3 * 2 * 64),  # forks of one sequence: every block read once
])
def test_the_kv_tokens_a_steps_sequences_share_are_counted_past_their_first_holder(tables, contexts, shared):
    assert _decodes(tables, contexts).shared_kv_tokens(64) == shared
