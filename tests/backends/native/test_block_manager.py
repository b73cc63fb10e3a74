"""Block manager: ref counts, prefix cache hits, LRU eviction, and exact free counts under any history,
driven through the scheduler's schedule → postprocess cycle."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.base import SamplingParams
from backends.native.block_manager import BlockManager, block_hash
from backends.native.config import EngineConfig
from backends.native.sampler import Sampled
from backends.native.scheduler import Scheduler
from backends.native.sequence import Sequence, Status
from backends.stopping import StopChecker
from backends.tokenizer import IncrementalDetokenizer

TOKENIZER = None  # set once by the module fixture: sequences detokenize as they grow


@pytest.fixture(scope="module", autouse=True)
def _tokenizer(smollm2_tokenizer):
    global TOKENIZER
    TOKENIZER = smollm2_tokenizer


def _seq(rid: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seq = Sequence(rid, tokens, params)
    seq.stop = StopChecker(params, IncrementalDetokenizer(TOKENIZER, tokens), frozenset(), max_tokens, 10**6)
    return seq


def _step(sched: Scheduler, token: int):
    """One scheduled step whose sampling sequences all get ``token``; None when nothing is scheduled."""
    step = sched.schedule()
    if step is not None:
        sched.postprocess(step, [Sampled(token) for _ in step.sampling])
    return step


def _prefill(bm: BlockManager, seq: Sequence) -> None:
    hits = bm.match_prefix(seq)
    assert bm.allocate(seq, seq.num_uncomputed - len(hits) * bm.block_size, hits)
    seq.num_computed = seq.num_tokens
    bm.register_full_blocks(seq)


def test_shared_prefix_is_reused_and_ref_counted():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = _seq("a", list(range(10)))
    _prefill(bm, a)
    b = _seq("b", list(range(8)) + [99, 98])
    assert bm.match_prefix(b) == a.block_table[:2]
    _prefill(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.num_free_blocks == 10 - 3 - 1  # a: 3 blocks, b: 1 new block
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 10


def test_never_a_hit_on_the_last_prompt_token():
    bm = BlockManager(num_blocks=10, block_size=4)
    _prefill(bm, _seq("a", list(range(8))))
    again = _seq("b", list(range(8)))  # two full blocks, but the last token must be computed
    assert len(bm.match_prefix(again)) == 1


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = _seq("a", [1, 2, 3, 4, 5])
    _prefill(bm, a)
    bm.free(a)
    assert len(bm.match_prefix(_seq("x", [1, 2, 3, 4, 5]))) == 2  # still cached after free
    filler = _seq("f", [7, 7, 7, 7, 7, 7, 7])  # needs all 4 blocks: evicts everything
    _prefill(bm, filler)
    bm.free(filler)
    assert bm.match_prefix(_seq("y", [1, 2, 3, 4, 5])) == []


def test_a_blocks_key_is_the_sha256_of_its_whole_prefix():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = _seq("a", [1, 2, 3, 4, 5]), _seq("b", [9, 9, 3, 4, 5])
    _prefill(bm, a)
    _prefill(bm, b)
    (a1, a2), (_, b2) = ([bm.blocks[i].hash for i in s.block_table[:2]] for s in (a, b))
    assert a1 == block_hash(None, [1, 2]) and a2 == block_hash(a1, [3, 4]) and len(a2) == 32
    assert a2 != b2  # same tokens [3, 4], other prefix: another key, so no false hit
    assert bm.match_prefix(_seq("c", [9, 8, 3, 4, 5])) == []


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = _seq("a", list(range(12)))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def _check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    owners: dict[int, int] = {}
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in one table"
        for b in seq.block_table:
            owners[b] = owners.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == owners.get(block.block_id, 0), "ref count differs from owners"
    assert bm.num_free_blocks == bm.num_blocks - len(owners)


events = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]),
                            st.integers(0, 5), st.integers(1, 40)), max_size=60)


@settings(max_examples=150, deadline=None, derandomize=True,  # reproducible in CI
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=events, num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 64), prefix_caching=st.booleans())
def test_scheduler_never_leaks_or_double_owns_blocks(events, num_blocks, block_size, budget, prefix_caching):
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    # Budgets below the deployment minimum (16) stress chunking: the scheduler itself takes any positive one.
    sched = Scheduler(EngineConfig.model_construct(max_num_seqs=4, max_num_batched_tokens=budget), bm)
    seqs: list[Sequence] = []
    for kind, pick, length in events:
        if kind == "add":
            tokens = [pick % 3] * length  # few distinct prompts: many prefix hits
            if bm.blocks_needed(length + 3) <= num_blocks:  # the engine's admission check
                seq = _seq(f"r{len(seqs)}", tokens, max_tokens=3)
                sched.add(seq)
                seqs.append(seq)
        elif kind == "abort" and seqs:
            sched.abort(seqs[pick % len(seqs)])
        elif kind == "step":
            step = _step(sched, 7)
            if step is not None:
                assert sum(step.num_tokens) <= budget
                assert all(s.status is Status.FINISHED for s in step.sampling if s.num_output >= 3)
        live = [s for s in seqs if s.status is not Status.FINISHED]
        _check_invariants(bm, [s for s in live if s.block_table])
    for seq in seqs:
        sched.abort(seq)
    assert bm.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_every_admitted_request_finishes_under_pressure():
    """Preemption by recompute makes progress: a full drain with a tiny cache terminates. Each request counts as
    admitted once (``Batch.admitted``: the step that first schedules it), not again when resumed after a
    preemption nor for its prompt's later chunks."""
    bm = BlockManager(num_blocks=6, block_size=2)
    sched = Scheduler(EngineConfig.model_construct(max_num_seqs=8, max_num_batched_tokens=5), bm)
    seqs = [_seq(f"r{i}", [i] * 5, max_tokens=4) for i in range(8)]
    for s in seqs:
        sched.add(s)
    admitted = 0
    for _ in range(500):
        if (step := _step(sched, 1)) is None:
            break
        admitted += step.batch.admitted
    assert all(s.status is Status.FINISHED for s in seqs)
    assert sched.num_preemptions > 0
    assert admitted == len(seqs)
    assert bm.num_free_blocks == 6
