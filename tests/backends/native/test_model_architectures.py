"""Random-weight Llama and Qwen2 models in every supported head layout match transformers exactly.

Each model is saved as an HF directory (safetensors, sometimes sharded) with SmolLM2's tokenizer, then
served by the full engine: prefill logits and batched greedy continuations must equal transformers'.
"""

from __future__ import annotations

import pytest
import torch

from backends.base import SamplingParams
from backends.native.attention import choose_kernels
from backends.native.batch import Batch
from backends.native.config import EngineConfig, ModelConfig
from backends.native.engine import LLMEngine
from backends.native.model_runner import build_model
from tests.backends.native.reference import hf_greedy_batch, prefill_batch

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

CASES = {
    # name: (transformers class, config overrides)
    "gqa1-d32": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32)),
    "gqa3-d64": ("llama", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=64)),
    "gqa4-d128": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128)),
    "llama3-rope": ("llama", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                                  rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
    "qwen2-bias": ("qwen2", dict(num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-6)),
    "untied-sharded": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
}


def _hf_model(kind: str, overrides: dict, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    base = dict(vocab_size=vocab_size, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    base.update(overrides)
    cls, cfg_cls = (LlamaForCausalLM, LlamaConfig) if kind == "llama" else (Qwen2ForCausalLM, Qwen2Config)
    torch.manual_seed(0)
    model = cls(cfg_cls(**base)).eval()
    with torch.no_grad():  # random biases (HF initialises them to zero, which would test nothing)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, smollm2_tokenizer):
    kind, overrides = CASES[request.param]
    hf = _hf_model(kind, overrides, smollm2_tokenizer.vocab_size)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, max_shard_size="2MB" if "sharded" in request.param else "1GB")
    smollm2_tokenizer.hf.save_pretrained(path)
    return hf, path


PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog. " * 6, "1 2 3", "A"]


def test_greedy_and_logits_match(case, smollm2_tokenizer):
    hf, path = case
    engine = LLMEngine(EngineConfig(model_path=str(path), dtype="float32", max_num_batched_tokens=40), tokenizer=smollm2_tokenizer)
    prompts = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    refs = hf_greedy_batch(hf, prompts, 12)

    # Batched prefill logits, one flat batch.
    logits = engine.runner.execute(prefill_batch(prompts, engine.blocks.block_size)[0])
    torch.testing.assert_close(logits, torch.stack([r[1] for r in refs]), atol=1e-4, rtol=1e-4)

    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r[0] for r in refs]


def test_12b_head_layout_runs_forward_in_bf16():
    """The 12.3B GQA shape (40 heads, 8 KV heads, head_dim 128, hidden 5120), two layers and a small
    vocabulary so the test fits in memory; random weights, bf16."""
    full = ModelConfig(vocab_size=100096, hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40,
                       num_kv_heads=8, head_dim=128)
    assert 12.0e9 < full.num_parameters() < 12.6e9
    cfg = ModelConfig(vocab_size=1024, hidden_size=5120, intermediate_size=1024, num_layers=2, num_heads=40,
                      num_kv_heads=8, head_dim=128)
    model = build_model(cfg, 256, torch.bfloat16, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    bs = 16
    kv = [(torch.zeros(8, 4, bs, 128, dtype=torch.bfloat16), torch.zeros(8, 4, bs, 128, dtype=torch.bfloat16))
          for _ in range(2)]
    kernels = choose_kernels("auto", cfg, torch.bfloat16, torch.device("cpu"), bs, 4)
    model.use_kernels(kernels)
    batch = Batch(list(range(20)), list(range(20)), list(range(20)), [20], [20], [[0, 1]], [True])
    with torch.inference_mode():
        logits = model(torch.arange(20), torch.arange(20), kv, kernels.attention.build(batch))
    assert logits.shape == (1, 1024) and torch.isfinite(logits).all()
