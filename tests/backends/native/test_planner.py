"""``burstgate plan``: the design's 12.3B GQA model (configs/llama-12.3b-gqa.json) on RTX 4090, A800 and
H100 against figures computed by hand here, and the KV capacity it predicts is what the engine allocates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from backends.native.config import EngineConfig, ModelConfig
from backends.native.engine import LLMEngine
from backends.native.model_runner import kv_cache_blocks
from backends.native.planner import plan
from gateway.cli import app

DESIGN = Path(__file__).resolve().parents[3] / "configs" / "llama-12.3b-gqa.json"
GIB = 2**30

# By hand: hidden 5120, intermediate 13824, 40 layers, 40 query / 8 KV heads of 128, vocab 100096, untied.
LAYER = (5120 + 2 * 1024) * 5120 + 5120 * 5120 + 3 * 13824 * 5120 + 2 * 5120  # 275,261,440
PARAMS = 2 * 100096 * 5120 + 40 * LAYER + 5120  # 12,035,445,760
LAYER_TP2 = (2560 + 2 * 512) * 5120 + 5120 * 2560 + 3 * 6912 * 5120 + 2 * 5120  # 137,635,840
PARAMS_TP2 = 2 * 50048 * 5120 + 40 * LAYER_TP2 + 5120  # 6,017,930,240
KV_PER_TOKEN = 2 * 40 * 8 * 128 * 2  # bf16 keys and values of every layer: 163,840 bytes
# The reserve for activations at 2048 batched tokens and 256 sequences, plus 1 GiB of CUDA context.
RESERVE = 2048 * ((40 + 16) * 128 + 2 * 13824 + 4 * 5120) * 2 + 256 * 100096 * 4 + GIB


@pytest.fixture(scope="module")
def design() -> ModelConfig:
    return ModelConfig.from_hf_file(DESIGN)


def test_the_preset_is_the_design(design):
    assert design.num_parameters() == PARAMS == 12_035_445_760  # 24.07 GB of bf16 weights
    assert (design.num_heads, design.num_kv_heads, design.head_dim, design.vocab_size) == (40, 8, 128, 100096)


def test_rtx4090_needs_two_gpus_in_bf16(design):
    single = plan(design, "rtx4090", tensor_parallel_size=1)
    assert not single.fits and single.sequences == 0 and "no room" in single.why
    assert single.weights_per_gpu_gib == pytest.approx(PARAMS * 2 / GIB)  # 22.42 GiB > 0.9 x 24 GiB
    best = plan(design, "rtx4090")
    assert best.tensor_parallel_size == 2 and best.fits
    assert best.weights_per_gpu_gib == pytest.approx(PARAMS_TP2 * 2 / GIB)  # 11.21 GiB
    assert best.kv_bytes_per_token_per_gpu == KV_PER_TOKEN // 2  # 4 of the 8 KV heads per GPU
    reserve_tp2 = 2048 * ((20 + 8) * 128 + 2 * 6912 + 4 * 5120) * 2 + 256 * 100096 * 4 + GIB
    blocks = (int(24 * GIB * 0.9) - PARAMS_TP2 * 2 - reserve_tp2) // (KV_PER_TOKEN // 2 * 16)
    assert best.kv_tokens == blocks * 16 and best.sequences == blocks // 40  # 640 tokens = 40 blocks each


@pytest.mark.parametrize("gpu, memory_gib, bandwidth", [("a800-80g", 80, 2039e9), ("h100", 80, 3350e9)])
def test_one_80gb_gpu_holds_the_model_and_hundreds_of_sequences(design, gpu, memory_gib, bandwidth):
    result = plan(design, gpu)
    assert result.tensor_parallel_size == 1 and result.fits
    blocks = (int(memory_gib * GIB * 0.9) - PARAMS * 2 - RESERVE) // (KV_PER_TOKEN * 16)
    assert result.kv_tokens == blocks * 16 and result.sequences == blocks // 40
    # Roofline at batch 1: every weight and 576 tokens of KV read once per token at the datasheet bandwidth.
    assert result.decode_tok_s_batch_1 == pytest.approx(bandwidth / (PARAMS * 2 + 576 * KV_PER_TOKEN))


def test_the_kv_capacity_predicted_is_what_the_engine_allocates(tmp_path):
    tiny = {**json.loads(DESIGN.read_text()), "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "head_dim": 32, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 49152}
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    engine = LLMEngine(EngineConfig(model_path=str(tmp_path / "config.json"), load_format="dummy", dtype="float32",
                                    kv_cache_gb=0.01, max_model_len=256, block_size=16))  # the planner's (CUDA's)
    predicted = kv_cache_blocks(ModelConfig.from_hf_dict(tiny), 16, torch.float32, int(0.01 * GIB))
    assert engine.blocks.num_blocks == predicted == int(0.01 * GIB) // (2 * 2 * 16 * 4 * 32 * 4)


@pytest.mark.parametrize("args, message", [
    (["--gpu", "tpu-v5"], "'tpu-v5' is not one of"),
    (["--gpu", "h100", "--tensor-parallel-size", "3"], "does not divide the model's 40 attention heads"),
])
def test_bad_plans_are_usage_errors_naming_the_value(args, message):
    result = CliRunner().invoke(app, ["plan", "--model", str(DESIGN), *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_a_config_missing_fields_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    result = CliRunner().invoke(app, ["plan", "--model", str(tmp_path / "config.json"), "--gpu", "h100"])
    assert result.exit_code == 2 and "missing model fields" in result.output


def test_the_plan_prints_as_json_for_scripts():
    result = CliRunner().invoke(app, ["plan", "--model", str(DESIGN), "--gpu", "h200", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.output)["tensor_parallel_size"] == 1
