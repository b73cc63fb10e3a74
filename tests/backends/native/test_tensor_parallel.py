"""Tensor parallelism on CPU (gloo, one worker process per extra rank): every split serves the same model.

Random-weight Llama models with the design's GQA shape (40 query / 8 KV heads, scaled down in width and
depth) split where the tensor-parallel size divides the KV heads, and a model with 2 KV heads split 4
ways (each KV head replicated on two ranks): greedy 64-token continuations of a batch of 16 prompts are
identical at TP 1, 2 and 4 and to transformers in fp32; SmolLM2 (9 query / 3 KV heads) at TP 3 equals
TP 1. Each rank holds 1/tp of the weights. A rank killed mid-burst (a tensor-parallel worker, or a pipeline
stage) fails every in-flight request and the deployment's health; a size that cannot split the model is refused
before any process starts.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine
from tests.backends.native.reference import hf_greedy_batch
from tests.backends.native.splits import assert_losing_a_rank_fails_requests_and_health, rank_weight_bytes, served

NEW_TOKENS = 24
DESIGN = Path(__file__).resolve().parents[3] / "configs" / "llama-12.3b-gqa.json"
# The design's head layout (40 query / 8 KV heads) at 1/8 of its width, 2 of its 40 layers, and SmolLM2's
# vocabulary (the prompts' token ids) in place of its own 100,096.
SCALED_DESIGN = {"hidden_size": 640, "intermediate_size": 13824 // 8, "num_hidden_layers": 2, "head_dim": 16,
                 "vocab_size": 49152, "max_position_embeddings": 512}
REPLICATED = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152, "max_position_embeddings": 512}


def _save_hf_model(path: Path, overrides: dict, tokenizer) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = {k: v for k, v in json.loads(DESIGN.read_text()).items() if k not in ("architectures", "torch_dtype")}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**config, **overrides})).eval()
    model.save_pretrained(path)
    tokenizer.hf.save_pretrained(path)
    return model


def _engine(path, tp: int, tokenizer, **overrides) -> LLMEngine:
    config = EngineConfig(model_path=str(path), tensor_parallel_size=tp, dtype="float32", max_model_len=512,
                          num_blocks=256, max_num_batched_tokens=256, num_threads=1, **overrides)
    return LLMEngine(config, tokenizer=tokenizer)


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    texts = ["Hello there", "The quick brown fox jumps over the lazy dog. " * 3, "1 2 3", "A", "def f(x):",
             "Once upon a time", "Paris is", "The history of computing is a story of abstraction. " * 4,
             "Q: What is the boiling point of water?\nA:", "import torch", "Dear hiring manager,", "<html>",
             "Roses are red,", "In summary,", "Step 1:", "The three laws of thermodynamics are"]
    return [smollm2_tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module", params=["design-40q-8kv", "replicated-8q-2kv"])
def model(request, tmp_path_factory, smollm2_tokenizer, prompts):
    """(HF directory, transformers' greedy continuations, the tensor-parallel sizes to check)."""
    overrides, sizes = (SCALED_DESIGN, (2, 4)) if request.param.startswith("design") else (REPLICATED, (4,))
    path = tmp_path_factory.mktemp(request.param)
    hf = _save_hf_model(path, overrides, smollm2_tokenizer)
    return path, [tokens for tokens, _ in hf_greedy_batch(hf, prompts, NEW_TOKENS)], sizes


def test_every_split_equals_one_rank_and_transformers(model, prompts, smollm2_tokenizer):
    path, reference, sizes = model
    single = _engine(path, 1, smollm2_tokenizer)
    assert _greedy(single, prompts) == reference
    total = single.runner.weight_bytes()
    for tp in sizes:
        engine = _engine(path, tp, smollm2_tokenizer)
        try:
            assert _greedy(engine, prompts) == reference, f"tp={tp}"
            per_rank = engine.runner.call("weight_bytes")
            copies = engine.runner.call("small_step_copy_bytes")  # a second copy for small steps (linear.py)
            # Measured: what each process holds once (oneDNN's packed copies pad a little), against 1/tp of the
            # whole plus the parts every rank holds; and a rank holds no more than its share of the whole model.
            expected = rank_weight_bytes(engine.model_config, tp)
            held_once = [b - c for b, c in zip(per_rank, copies)]
            assert len(per_rank) == tp and all(abs(b - expected) <= 0.01 * expected for b in held_once), held_once
            assert max(per_rank) < 1.1 * total / tp
            assert not engine.has_unfinished() and engine.blocks.num_free_blocks == engine.blocks.num_blocks
        finally:
            engine.close()


def test_smollm2_split_three_ways_equals_one_rank(native_engine, prompts):
    engine = LLMEngine(EngineConfig(tensor_parallel_size=3, dtype="float32", max_model_len=1024, num_blocks=256,
                                    max_num_batched_tokens=512, num_threads=1), tokenizer=native_engine.tokenizer)
    try:
        assert engine.runner.call("weight_bytes")  # three ranks answer
        assert _greedy(engine, prompts[:6]) == _greedy(native_engine, prompts[:6])
    finally:
        engine.close()


@pytest.mark.parametrize("overrides, message", [
    ({"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 16, "hidden_size": 144}, "9 attention heads"),
    ({"num_key_value_heads": 3, "num_attention_heads": 6, "head_dim": 16, "hidden_size": 96},
     "3 key/value heads"),
])
def test_a_size_that_cannot_split_the_model_is_refused_before_any_worker_starts(tmp_path, smollm2_tokenizer,
                                                                               overrides, message):
    path = tmp_path / "model"
    _save_hf_model(path, {**REPLICATED, **overrides}, smollm2_tokenizer)
    with pytest.raises(ValueError, match=message):
        _engine(path, 4 if "attention" in message else 2, smollm2_tokenizer)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_a_rank_killed_mid_burst_fails_its_requests_and_the_deployment(tmp_path, smollm2_tokenizer, split):
    path = tmp_path / "model"
    _save_hf_model(path, REPLICATED, smollm2_tokenizer)
    engine = _engine(path, split.get("tensor_parallel_size", 1), smollm2_tokenizer,
                     pipeline_parallel_size=split.get("pipeline_parallel_size", 1))
    try:
        with served(engine) as url:
            assert_losing_a_rank_fails_requests_and_health(url, "split", lambda: engine.runner.workers.kill(0))
    finally:
        engine.close()
    assert not multiprocessing.active_children()
