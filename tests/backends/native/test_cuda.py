"""The native engine on a CUDA device keeps every guarantee of the CPU path: SmolLM2's greedy tokens equal
transformers' on the same device in fp32 (CUDA graphs and eager, prefix caching, chunked prefill,
preemption, with async scheduling and without), bf16 logits within bf16 rounding of transformers' bf16,
graph replays equal to eager steps, and a KV cache sized from ``gpu_memory_utilization``.

Skipped without a GPU; on one: ``make test-cuda`` (the attention kernels' own checks against plain
attention run on the device in the same command: attention/test_backends.py).
"""

from __future__ import annotations

import gc

import pytest
import torch

from backends.base import SamplingParams
from backends.native.batch import Batch
from backends.native.config import EngineConfig
from backends.native.cuda_graphs import capture_sizes
from backends.native.engine import LLMEngine
from tests.backends.native.reference import hf_greedy_batch, parity_prompts, prefill_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    return parity_prompts(smollm2_tokenizer)


def _hf(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).cuda().eval()


@pytest.fixture(scope="module")
def reference(smollm2_path, prompts):
    """transformers in fp32 on the same GPU (TF32 off, torch's default for matmuls)."""
    model = _hf(smollm2_path, torch.float32)
    refs = hf_greedy_batch(model, prompts, NEW_TOKENS)
    del model
    torch.cuda.empty_cache()
    return refs


def _engine(tokenizer, **overrides) -> LLMEngine:
    settings = dict(device="cuda", dtype="float32", max_model_len=1024, max_num_seqs=64, kv_cache_gb=1.0)
    return LLMEngine(EngineConfig(**{**settings, **overrides}), tokenizer=tokenizer)


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert all(o.finish_reason == "length" for o in outs)
    return [o.token_ids for o in outs]


def _assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_the_engine_runs_on_the_gpu_with_the_triton_kernel_and_graphs(smollm2_tokenizer):
    engine = _engine(smollm2_tokenizer, device="auto", dtype="auto")
    assert engine.runner.device.type == "cuda" and engine.runner.dtype == torch.bfloat16
    assert engine.overlap_steps  # async scheduling
    assert type(engine.runner.kernels.attention).__name__ == "TritonAttention"
    assert engine.runner.graphs is not None and engine.runner.graphs.sizes == capture_sizes(64)
    assert engine.runner.kv_caches[0][0].is_cuda


@pytest.mark.parametrize("variant", [
    dict(),
    dict(enforce_eager=True),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=50),  # chunked prefill, chunks not aligned to blocks
    dict(num_blocks=48, max_num_batched_tokens=97),  # forced preemption
    dict(kernels="torch"),  # the pure-torch attention path on the GPU
    dict(async_scheduling=False),  # on by default on CUDA: each step's tokens on the host before the next
], ids=["graphs", "eager", "no-prefix-cache", "chunked-50", "preemption", "torch-kernels", "synchronous"])
def test_batched_greedy_equals_transformers_on_the_gpu(smollm2_tokenizer, prompts, reference, variant):
    engine = _engine(smollm2_tokenizer, **variant)
    assert _greedy(engine, prompts) == [tokens for tokens, _ in reference]
    _assert_idle(engine)
    if "num_blocks" in variant:
        assert engine.stats().preemptions > 0


def test_prefix_cache_hits_keep_outputs_identical_on_the_gpu(smollm2_tokenizer, prompts, reference):
    engine = _engine(smollm2_tokenizer)
    first = _greedy(engine, prompts)
    hits = engine.stats().prefix_cache_hits
    assert _greedy(engine, prompts) == first == [tokens for tokens, _ in reference]
    assert engine.stats().prefix_cache_hits - hits > sum(len(p) for p in prompts) // 2
    _assert_idle(engine)


def _prefill_logits(engine: LLMEngine, prompts: list[list[int]], spare: int = 0) -> tuple[torch.Tensor, list]:
    """Last-position logits of one flat prefill step, and its block tables (room for ``spare`` more tokens)."""
    batch, tables = prefill_batch(prompts, engine.blocks.block_size, spare)
    return engine.runner.execute(batch).cpu(), tables


def test_fp32_logits_match_and_bf16_logits_stay_within_bf16_rounding(smollm2_path, smollm2_tokenizer, prompts,
                                                                        reference):
    expected = torch.stack([logits for _, logits in reference])
    fp32, _ = _prefill_logits(_engine(smollm2_tokenizer), prompts)
    torch.testing.assert_close(fp32, expected, atol=1e-3, rtol=0)
    ours, _ = _prefill_logits(_engine(smollm2_tokenizer, dtype="bfloat16"), prompts)
    model = _hf(smollm2_path, torch.bfloat16)
    with torch.inference_mode():
        theirs = torch.stack([model(torch.tensor([p], device="cuda")).logits[0, -1].float().cpu() for p in prompts])
    # Both bf16 runs are as far from fp32 as each other, and agree on the top token almost everywhere.
    our_error, their_error = (ours - expected).abs().mean(), (theirs - expected).abs().mean()
    assert our_error < 1.5 * their_error + 1e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


def test_graph_replays_equal_eager_steps_at_every_padding(smollm2_tokenizer, prompts):
    engine = _engine(smollm2_tokenizer, max_num_seqs=32)
    bs = engine.blocks.block_size
    for n in (1, 3, 13):  # padded to the graphs of 1, 4 and 16 rows
        seqs = prompts[:n]
        _, tables = _prefill_logits(engine, seqs, spare=1)  # the prompts' keys and values in the cache
        slots = [t[len(p) // bs] * bs + len(p) % bs for p, t in zip(seqs, tables)]
        batch = Batch([p[-1] for p in seqs], [len(p) for p in seqs], slots, [1] * n, [len(p) + 1 for p in seqs],
                      tables, [True] * n)
        replayed = engine.runner.execute(batch).clone()
        graphs, engine.runner.graphs = engine.runner.graphs, None
        eager = engine.runner.execute(batch)
        engine.runner.graphs = graphs
        assert replayed.shape == eager.shape == (n, engine.vocab_size)
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("share", [0.3, 0.6])
def test_the_kv_cache_takes_what_gpu_memory_utilization_leaves(smollm2_tokenizer, share):
    gc.collect()  # engines of earlier tests, and their graphs' memory pools
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", gpu_memory_utilization=share,
                                    max_num_seqs=16), tokenizer=smollm2_tokenizer)
    free_after, _ = torch.cuda.mem_get_info()
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in engine.runner.kv_caches)
    used_by_us = free_before - free_after
    assert kv_bytes > 0.5 * (share * total - (total - free_before))  # most of what the share leaves
    assert used_by_us <= share * total - (total - free_before) + (1 << 30)  # and not more (graphs: slack)
    del engine
    torch.cuda.empty_cache()
