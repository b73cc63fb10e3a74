"""n > 1, logit_bias and prompt logprobs on the native engine, with vLLM's semantics: the n samples share the
prompt's KV blocks (reference-counted; a shared partly filled block is copied before it is written), sample i
is seeded with seed + i (vllm/v1/engine/parallel_sampling.py), usage counts the prompt once and sums the
samples, logit_bias is added before penalties (vllm/v1/sample/sampler.py), prompt logprobs skip the prefix
cache and rank each prompt token (vllm/v1/worker/gpu_model_runner.py ``_get_prompt_logprobs_dict``)."""

from __future__ import annotations

from backends.base import SamplingParams
from backends.native.block_manager import BlockManager
from backends.native.config import EngineConfig
from backends.native.sampler import Sampled
from backends.native.scheduler import Scheduler
from backends.native.sequence import Sequence
from backends.stopping import StopChecker
from backends.tokenizer import IncrementalDetokenizer

PROMPT = "Once upon a time, in a land far away, there lived a"


def test_n_samples_are_seeded_per_index_and_reproducible(native_engine, engine_idle):
    prompt = native_engine.tokenizer.encode(PROMPT)
    params = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    first = native_engine.generate([prompt], params)
    again = native_engine.generate([prompt], params)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.index for c in first] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in first}) > 1  # different samples, not one sample four times
    # Sample i draws with seed + i: its first token, drawn from the prompt's logits (computed once, as for a
    # single request), is what a single request seeded with seed + i draws. Later tokens come from decode steps
    # batched four ways rather than one, whose logits may differ in the last bits (no engine is batch-invariant
    # by default, vLLM included), so a draw near a tie may differ: they are not compared.
    singles = [native_engine.generate([prompt], SamplingParams(temperature=1.0, seed=42 + i, max_tokens=1,
                                                                ignore_eos=True))[0].token_ids for i in range(4)]
    assert singles == [c.token_ids[:1] for c in first]
    assert len({tuple(t) for t in singles}) > 1  # the seeds differ per sample
    # Usage: the prompt once, the completions summed.
    assert first[-1].usage.prompt_tokens == len(prompt)
    assert first[-1].usage.completion_tokens == 4 * 12


def test_greedy_n_is_refused_as_vllm_does(native_engine):
    import pytest

    from backends.base import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="greedy") as err:
        native_engine.check_request([1, 2], SamplingParams(n=2, temperature=0.0))
    assert err.value.param == "n"
    with pytest.raises(InvalidRequestError) as err:
        native_engine.check_request([1, 2], SamplingParams(n=native_engine.config.max_n + 1))
    assert err.value.param == "n"


def _seq(tokenizer, rid, tokens, index=0, max_tokens=8):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seq = Sequence(rid, list(tokens), params, index=index)
    seq.stop = StopChecker(params, IncrementalDetokenizer(tokenizer, tokens), frozenset(), max_tokens, 10**6)
    return seq


def test_forks_share_the_prompt_blocks_and_copy_the_partial_one_before_writing(smollm2_tokenizer):
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(EngineConfig(max_num_batched_tokens=64), bm)
    parent = _seq(smollm2_tokenizer, "r", range(10))  # blocks: 4 + 4 + 2 (partial)
    kids = [_seq(smollm2_tokenizer, "r", range(10), index=i) for i in (1, 2)]
    parent.forks = kids
    sched.add(parent)
    step = sched.schedule()
    assert step.sampling == [parent, *kids]  # the forks sample from the prompt's logits row
    sched.postprocess(step, [Sampled(7), Sampled(8), Sampled(9)])
    assert all(k.block_table == parent.block_table for k in kids)
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [3, 3, 3]
    assert bm.num_free_blocks == 16 - 3
    step = sched.schedule()  # all three write position 10, in the shared partial block
    copies = step.batch.block_copies
    assert len(copies) == 2 and all(src == parent.block_table[2] or src in (k.block_table[2] for k in kids)
                                    for src, _ in copies)
    tails = {s.block_table[2] for s in (parent, *kids)}
    assert len(tails) == 3  # each writes its own tail block now; the full blocks stay shared
    assert [bm.blocks[b].ref_count for b in parent.block_table[:2]] == [3, 3]
    sched.postprocess(step, [Sampled(1), Sampled(2), Sampled(3)])
    for s in (parent, *kids):
        sched.abort(s)
    assert bm.num_free_blocks == 16


def test_copy_on_write_keeps_every_sample_exact(native_engine, engine_idle):
    """Samples forked from a prompt whose last block is partial equal independent requests token for token:
    the copied block carries the prompt's keys and values."""
    prompt = native_engine.tokenizer.encode(PROMPT)
    assert len(prompt) % native_engine.blocks.block_size != 0
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    forked = native_engine.generate([prompt], params)
    singles = native_engine.generate([prompt] * 3, [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=20,
                                                                    ignore_eos=True) for i in range(3)])
    assert [c.token_ids for c in forked] == [c.token_ids for c in singles]


def test_logit_bias_forces_and_forbids_tokens(native_engine, engine_idle):
    prompt = native_engine.tokenizer.encode("The capital of France is")
    (free,) = native_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    forced_id = native_engine.tokenizer.encode(" banana")[0]
    (forced,) = native_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                                 logit_bias={forced_id: 100.0}))
    assert forced.token_ids == [forced_id] * 4
    (forbidden,) = native_engine.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={t: -100.0 for t in free.token_ids}))
    assert not set(forbidden.token_ids) & set(free.token_ids)


def test_prompt_logprobs_equal_the_logprobs_of_the_same_tokens_generated(native_engine, engine_idle):
    """A greedy continuation's logprobs, scored again as part of a prompt, come back as its prompt logprobs
    (rank 1: greedy picked the most likely token), and every other prompt token has its own rank."""
    prompt = native_engine.tokenizer.encode(PROMPT)
    (cont,) = native_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                               logprobs=2))
    (out,) = native_engine.generate([prompt + cont.token_ids], SamplingParams(temperature=0.0, max_tokens=1,
                                                                               prompt_logprobs=2))
    entries = out.prompt_logprobs
    assert entries[0] is None and len(entries) == len(prompt) + 6
    assert [e.token_id for e in entries[1:]] == (prompt + cont.token_ids)[1:]
    for generated, scored in zip(cont.logprobs, entries[len(prompt):]):
        assert abs(generated.logprob - scored.logprob) < 1e-4 and scored.rank == 1
        assert [t for t, _, _ in generated.top] == [t for t, _, _ in scored.top]
    for e in entries[1:]:
        assert e.top[0][0] == e.token_id and e.rank >= 1
        assert (e.rank == 1) == (e.logprob >= max(lp for _, _, lp in e.top) - 1e-6)
