"""``kv_cache_dtype: fp8`` (vLLM's ``--kv-cache-dtype``): keys and values stored in one byte (e4m3, or e5m2), so the
same memory holds twice the tokens of a bf16 cache and a decode step reads half the bytes; SmolLM2 on it picks the
greedy token of a cache in the model's dtype nearly always (teacher-forced), leaves no block behind, and the option
is refused where its kernels do not run. The kernels' rounding and reading are test_layer_ops.py's and
attention/test_backends.py's; the fused step's, test_fused_step.py's."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine
from backends.native.model_runner import ModelRunner
from backends.native.weights import open_checkpoint
from tests.backends.native.reference import parity_prompts


@pytest.fixture(scope="module")
def greedy_reference(smollm2_tokenizer):
    """The parity prompts' greedy continuations with a cache in the model's dtype (``auto``: bf16 on CPUs that
    compute in it, else fp32), and that engine's settings."""
    prompts = parity_prompts(smollm2_tokenizer)
    engine = LLMEngine(EngineConfig(max_model_len=1024, kv_cache_gb=0.5, warmup=False), tokenizer=smollm2_tokenizer)
    try:
        outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
        return prompts, [o.token_ids for o in outs], engine.settings()
    finally:
        engine.close()


@pytest.mark.parametrize("kv_cache_dtype, floor", [("fp8", 0.93), ("fp8_e5m2", 0.88)])
def test_smollm2_on_an_fp8_kv_cache_holds_twice_the_tokens_and_keeps_its_greedy_choices(
        smollm2_tokenizer, greedy_reference, kv_cache_dtype, floor):
    """Teacher-forced: the fp8 engine reads each prompt and the reference's continuation, and its top token at each of
    those positions is compared with the reference's choice. Measured on the parity prompts: in bf16, 749 of 768 =
    97.5% with e4m3 (3 mantissa bits), 714 = 93.0% with e5m2 (2 bits), where the reference itself, reading its own
    continuations whole, gives 762 = 99.2%; in fp32, 728 = 94.8% and 698 = 90.9%."""
    prompts, continuations, reference = greedy_reference
    engine = LLMEngine(EngineConfig(max_model_len=1024, kv_cache_gb=0.5, warmup=False, kv_cache_dtype=kv_cache_dtype),
                       tokenizer=smollm2_tokenizer)
    try:
        info = engine.settings()
        assert info["kv_cache_dtype"] == {"fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[kv_cache_dtype]
        assert info["dtype"] == reference["dtype"] and info["fused_steps"] == reference["fused_steps"]
        # the same bytes hold twice the blocks (of 2 bytes per value in bf16, 4 in fp32)
        per_value = torch.empty(0, dtype=getattr(torch, reference["dtype"])).element_size()
        assert info["num_blocks"] == reference["num_blocks"] * per_value
        assert info["kv_cache_bytes"] == reference["kv_cache_bytes"]
        outs = engine.generate([p + c for p, c in zip(prompts, continuations)],
                               SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
        ranks = [lp.rank for p, o in zip(prompts, outs) for lp in o.prompt_logprobs[len(p):]]
        assert len(ranks) == 32 * len(prompts)
        agreement = sum(r == 1 for r in ranks) / len(ranks)
        assert agreement >= floor, f"{kv_cache_dtype} agrees with the reference's greedy token {agreement:.1%} of the time"
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    finally:
        engine.close()


def test_an_fp8_kv_cache_is_refused_where_its_kernels_do_not_run(smollm2_path):
    """CUDA's Triton kernels read caches in the model's dtype: refused before anything is loaded (no GPU is needed to
    see it: the check comes first). Unknown names are refused by the config."""
    config = EngineConfig(dtype="bfloat16", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 runs on CPU only"):
        ModelRunner(config, open_checkpoint(smollm2_path), 256, device=torch.device("cuda"))
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
    assert EngineConfig().torch_kv_cache_dtype(torch.float32) == torch.float32  # auto: the model's dtype
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").torch_kv_cache_dtype(torch.bfloat16) == torch.float8_e4m3fn
