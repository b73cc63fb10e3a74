"""Engine settings: ``dtype: auto`` picks bf16 only where the CPU multiplies bf16 in hardware, KV blocks are
longer on CPUs than on GPUs unless asked for, devices are named and checked, and the start-up warm-up leaves
nothing behind."""

from __future__ import annotations

import pytest
import torch

from backends.base import SamplingParams
from backends.native import config as engine_config
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine

CPU = torch.device("cpu")


@pytest.mark.parametrize("flags, expected", [
    ("fpu sse avx2 fma", torch.float32),  # this project's AMD machine: no native bf16
    ("avx512f avx512bw avx512_bf16", torch.bfloat16),  # AVX512-BF16 (Cooper Lake, Zen 4)
    ("avx512f amx_tile amx_bf16", torch.bfloat16),  # AMX (Sapphire Rapids)
    ("avx512f avx512bw avx512vl", torch.float32),  # AVX-512 without bf16: emulated, slower than fp32
])
def test_auto_dtype_is_bf16_only_with_native_bf16_on_the_cpu(tmp_path, monkeypatch, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    monkeypatch.setattr(engine_config, "CPUINFO", cpuinfo)
    assert EngineConfig(dtype="auto").torch_dtype(CPU) is expected
    assert EngineConfig(dtype="float32").torch_dtype(CPU) is torch.float32  # always one option away


def test_kv_blocks_default_to_64_tokens_on_cpu_and_16_on_cuda_unless_given():
    assert EngineConfig().kv_block_size(CPU) == 64  # vLLM's CPU backend: 128, our kernels' most is 64
    assert EngineConfig().kv_block_size(torch.device("cuda", 0)) == 16  # vLLM's GPU default
    assert EngineConfig(block_size=16).kv_block_size(CPU) == 16
    assert EngineConfig(block_size=32).kv_block_size(torch.device("cuda", 0)) == 32
    with pytest.raises(ValueError):
        EngineConfig(block_size=128)


def test_devices_are_checked_where_they_are_resolved():
    assert EngineConfig(device="cpu").torch_device() == CPU
    assert EngineConfig(device="auto").torch_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            EngineConfig(device="cuda:0").torch_device()
    with pytest.raises(ValueError):
        EngineConfig(device="tpu")


def test_the_warm_up_leaves_no_sequence_block_cache_entry_or_count_behind(smollm2_tokenizer):
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=512, num_blocks=64), tokenizer=smollm2_tokenizer)
    assert not engine.has_unfinished() and not engine.request_ids()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.blocks._cached
    stats = engine.stats()
    assert (stats.prompt_tokens, stats.generation_tokens, stats.prefix_cache_queries, stats.preemptions) == (0, 0, 0, 0)
    (out,) = engine.generate([smollm2_tokenizer.encode("Hello")], SamplingParams(max_tokens=3, temperature=0))
    assert len(out.token_ids) == 3 and engine.stats().generation_tokens == 3
