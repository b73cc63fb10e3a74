"""Fixtures the engine's split tests share (pipeline parallelism in process and across a Ray cluster)."""

from __future__ import annotations

import pytest
import torch

TINY_LLAMA = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 5, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152, "max_position_embeddings": 512,
              "tie_word_embeddings": True,
              "initializer_range": 0.15}  # large enough for varied continuations (HF's 0.02 repeats one token)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_tokenizer):
    """An HF directory with a random-weight 5-layer Llama and SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(path)
    smollm2_tokenizer.hf.save_pretrained(path)
    return path
