"""Fixtures shared by every test package: the embedded model and transformers as the reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from backends.native.weights import default_model_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a model hub
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' own loading of the same GGUF, in fp32: the reference for correctness."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from backends.native.tokenizer import Tokenizer

    return Tokenizer(smollm2_path)
