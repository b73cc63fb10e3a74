"""On CPU every step is padded to one of a few row counts, so that oneDNN compiles each matmul shape once,
at start-up, instead of once per new token count while serving; the padding changes no result."""

from __future__ import annotations

import pytest
import torch

from backends.native.batch import Batch
from backends.native.config import EngineConfig
from backends.native.linear import Linear
from backends.native.model_runner import ModelRunner
from backends.native.row_buckets import buckets, padded_rows
from backends.native.weights import default_model_path, open_checkpoint
from tests.backends.native.reference import prefill_batch


def test_every_row_count_up_to_the_token_budget_pads_to_one_of_a_few_buckets():
    sizes = buckets(2048)
    assert len(sizes) <= 64 and sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == 2048
    for n in range(1, 2049):
        assert padded_rows(n) in sizes
        assert n <= padded_rows(n) <= n + (15 if n <= 256 else 63)
    assert buckets(100)[-1] == padded_rows(100) == 112  # a budget between buckets: the one that holds it


@pytest.fixture(scope="module")
def runner():
    # eager: the padding is for steps through the torch modules (a fused step, fused_step.py, takes any row count)
    config = EngineConfig(dtype="float32", device="cpu", load_format="dummy", max_model_len=256, num_blocks=64,
                          warmup=False, enforce_eager=True)
    runner = ModelRunner(config, open_checkpoint(default_model_path()), config.max_model_len)
    assert runner.pad_rows  # a CPU with oneDNN: the packed weights are what pads
    return runner


def _steps(block_size: int) -> tuple[Batch, Batch]:
    """A prefill of 53 tokens (three prompts), then a step of two decodes and a chunk of 5 tokens."""
    prompts = [list(range(100, 137)), list(range(200, 205)), list(range(300, 311))]
    prefill, tables = prefill_batch(prompts, block_size, spare=8)
    slot = [lambda i, t=t: t[i // block_size] * block_size + i % block_size for t in tables]
    mixed = Batch([7, 8, 9, 10, 11, 12, 13], [37, 5, 11, 12, 13, 14, 15],
                  [slot[0](37), slot[1](5), *(slot[2](i) for i in range(11, 16))],
                  [1, 1, 5], [38, 6, 16], tables, [True] * 3)
    return prefill, mixed


@torch.inference_mode()
def test_a_padded_step_computes_what_the_unpadded_one_does(runner):
    results = {}
    for pad in (False, True):
        runner.pad_rows = pad
        for k_cache, v_cache in runner.kv_caches:
            k_cache.zero_(), v_cache.zero_()
        logits = [runner.execute(step) for step in _steps(runner.block_size)]
        results[pad] = logits, [c[:, :-1].clone() for pair in runner.kv_caches for c in pair]  # all but scratch
    runner.pad_rows = True
    (plain, plain_kv), (padded, padded_kv) = results[False], results[True]
    assert [t.shape for t in padded] == [t.shape for t in plain] == [(3, runner.model.config.vocab_size)] * 2
    for a, b in zip(padded + padded_kv, plain + plain_kv):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_every_matmul_of_a_step_sees_a_bucketed_row_count(runner):
    seen = []
    hooks = [m.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
             for m in runner.model.modules() if isinstance(m, Linear)]
    try:
        for step in _steps(runner.block_size):
            runner.execute(step)
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(set(seen)) == [padded_rows(3), padded_rows(7), padded_rows(53)]  # LM head: 3 rows each


def test_a_model_whose_every_matmul_is_a_tile_kernel_pads_no_step():
    # bf16 on AMX: the tile layouts serve every step of SmolLM2's layers and take any row count
    # eager, for the layers' hooks to see each matmul (a fused step, fused_step.py, takes any row count as well)
    config = EngineConfig(dtype="bfloat16", device="cpu", load_format="dummy", max_model_len=256, num_blocks=64,
                          warmup=False, enforce_eager=True)
    runner = ModelRunner(config, open_checkpoint(default_model_path()), config.max_model_len)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    if not all(m.layout_only for m in linears):
        pytest.skip("no AMX tiles on this CPU (or no C kernels)")
    assert not runner.pad_rows
    seen = []
    hooks = [m.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0])) for m in linears]
    try:
        with torch.inference_mode():
            runner.execute(_steps(runner.block_size)[0])
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(set(seen)) == [3, 53]  # the LM head's rows and the prompts' tokens, unpadded
