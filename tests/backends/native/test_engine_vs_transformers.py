"""The native engine on SmolLM2 (fp32, CPU) produces exactly transformers' greedy tokens.

One batch of varied prompts (chat and raw text, 6 to ~400 tokens, shared prefixes) runs together,
under every scheduling variant: prefix caching on and off, chunked prefill with small odd budgets,
no chunking, a KV cache so small that sequences are preempted and recomputed, and the pure-torch
decode path instead of the paged kernel.
"""

from __future__ import annotations

import pytest
import torch

from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine
from tests.backends.native.reference import hf_greedy_batch, parity_prompts, prefill_batch

NEW_TOKENS = 32  # enough to compound any drift
@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    return parity_prompts(smollm2_tokenizer)


@pytest.fixture(scope="module")
def reference(hf_smollm2, prompts):
    return hf_greedy_batch(hf_smollm2, prompts, NEW_TOKENS)


def _engine(tokenizer, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", max_model_len=1024, **overrides), tokenizer=tokenizer)


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert all(o.finish_reason == "length" for o in outs)
    return [o.token_ids for o in outs]


def _assert_no_leak(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_prompts_are_varied(prompts):
    assert len(prompts) >= 20
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] < 10 and lengths[-1] > 300


def test_last_position_logits_match_within_1e3(smollm2_tokenizer, prompts, reference):
    engine = _engine(smollm2_tokenizer)
    batch, _ = prefill_batch(prompts, engine.blocks.block_size)  # all prompts in one flat step
    logits = engine.runner.execute(batch)
    expected = torch.stack([ref_logits for _, ref_logits in reference])
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize("variant", [
    dict(),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=50),  # chunked prefill, chunks not aligned to blocks
    dict(enable_chunked_prefill=False, max_num_batched_tokens=1024),
    dict(num_blocks=48, block_size=16, max_num_batched_tokens=97),  # 768 tokens of KV for ~2,700: forced preemption
    dict(kernels="torch"),  # the pure-torch paths (no C compiler) instead of the C kernels
], ids=["default", "no-prefix-cache", "chunked-50", "no-chunking", "preemption", "torch-kernels"])
def test_batched_greedy_equals_transformers(smollm2_tokenizer, prompts, reference, variant):
    engine = _engine(smollm2_tokenizer, **variant)
    assert _greedy(engine, prompts) == [tokens for tokens, _ in reference]
    _assert_no_leak(engine)
    if "num_blocks" in variant:
        assert engine.stats().preemptions > 0


def test_prefix_cache_hits_keep_outputs_identical(smollm2_tokenizer, prompts, reference):
    engine = _engine(smollm2_tokenizer)
    first = _greedy(engine, prompts)
    hits_before = engine.stats().prefix_cache_hits
    second = _greedy(engine, prompts)  # every prompt's full blocks are cached now
    bs = engine.blocks.block_size  # a prompt's last token is computed again, as vLLM does: its logits are needed
    assert engine.stats().prefix_cache_hits - hits_before == sum((len(p) - 1) // bs * bs for p in prompts) > 0
    assert first == second == [tokens for tokens, _ in reference]
    _assert_no_leak(engine)
