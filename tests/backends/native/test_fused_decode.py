"""A small decode step runs the whole decoder stack in one C call (fused_decode.py) and leaves bit for bit the
logits and KV cache of the eager path, for every kind of small-step copy this CPU has (AMX tiles of bf16 or
int8 weights, AVX-512 strips of fp32 ones); steps with a prefill chunk, larger steps and ``enforce_eager``
run eagerly."""

from __future__ import annotations

import json

import pytest
import torch

from backends.native.batch import Batch
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine
from backends.native.model_runner import ModelRunner
from backends.native.weights import open_checkpoint
from tests.backends.native.reference import prefill_batch

# Qwen2: q/k/v with biases, which the C path adds after the projection as torch does
TINY_QWEN2 = {"model_type": "qwen2", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": True}
COPIES = {"bf16-tiles": dict(dtype="bfloat16"), "int8-tiles": dict(dtype="bfloat16", quantization="int8"),
          "fp32-strips": dict(dtype="float32")}
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2") / "config.json"
    path.write_text(json.dumps(TINY_QWEN2))
    return path


def _runner(model_path, eager: bool, **fields) -> ModelRunner:
    config = EngineConfig(model_path=str(model_path), load_format="dummy", device="cpu", max_model_len=256,
                          num_blocks=64, block_size=BLOCK_SIZE, warmup=False, enforce_eager=eager, **fields)
    return ModelRunner(config, open_checkpoint(model_path), config.max_model_len)


def _steps() -> list[Batch]:
    """A prefill of three prompts, two decode steps of all three (the second samples the first and last only),
    then one of the first alone."""
    prompts = [list(range(100, 137)), list(range(200, 205)), list(range(300, 316))]
    prefill, tables = prefill_batch(prompts, BLOCK_SIZE, spare=8)
    lens = [len(p) for p in prompts]
    steps = [prefill]
    for token, sample in ((7, [True] * 3), (8, [True, False, True])):
        slots = [t[n // BLOCK_SIZE] * BLOCK_SIZE + n % BLOCK_SIZE for t, n in zip(tables, lens)]
        steps.append(Batch([token + i for i in range(3)], lens, slots, [1, 1, 1], [n + 1 for n in lens], tables,
                           sample))
        lens = [n + 1 for n in lens]
    slot = tables[0][lens[0] // BLOCK_SIZE] * BLOCK_SIZE + lens[0] % BLOCK_SIZE
    steps.append(Batch([9], [lens[0]], [slot], [1], [lens[0] + 1], tables[:1], [True]))
    return steps


@pytest.mark.parametrize("fields", COPIES.values(), ids=COPIES)
def test_a_fused_decode_step_leaves_the_eager_steps_logits_and_kv_cache(tiny_model, fields):
    eager, fused = _runner(tiny_model, True, **fields), _runner(tiny_model, False, **fields)
    if fused.fused is None:
        pytest.skip("this CPU has no small-step copies for these weights (AMX tiles, AVX-512 strips)")
    assert eager.fused is None  # enforce_eager: every step through the torch modules
    fused_steps, run = [], fused.fused.run
    fused.fused.run = lambda *args: fused_steps.append(len(args[0])) or run(*args)
    for batch in _steps():
        expected, got = eager.execute(batch), fused.execute(batch)
        assert got.shape[0] == sum(batch.sample) and torch.equal(got, expected)
    assert fused_steps == [3, 3, 1]  # the prefill ran eagerly, every decode step fused
    for eager_cache, fused_cache in zip(eager.kv_caches, fused.kv_caches):
        for expected, got in zip(eager_cache, fused_cache):  # all but the scratch block the eager padding writes
            assert torch.equal(got[:, :-1], expected[:, :-1])


def test_steps_with_a_prefill_chunk_or_more_rows_than_the_copies_serve_run_eagerly(tiny_model):
    runner = _runner(tiny_model, False, dtype="float32")
    if runner.fused is None:
        pytest.skip("this CPU has no AVX-512 strips")
    prefill, *decodes = _steps()
    assert not runner.fused.can_run(prefill) and all(runner.fused.can_run(b) for b in decodes)
    mixed = Batch([1, 2, 3], [37, 5, 6], [0, 1, 2], [1, 2], [38, 7], [[0, 1, 2], [3]], [True, True])
    assert not runner.fused.can_run(mixed)
    n = runner.fused.max_rows + 1
    wide = Batch([1] * n, [0] * n, list(range(n)), [1] * n, [1] * n, [[i] for i in range(n)], [True] * n)
    assert not runner.fused.can_run(wide)


def test_get_info_says_whether_small_decode_steps_run_fused(tiny_model, smollm2_tokenizer):
    shown = {}
    for eager in (False, True):
        config = EngineConfig(model_path=str(tiny_model), load_format="dummy", device="cpu", dtype="float32",
                              num_blocks=16, warmup=False, enforce_eager=eager)
        shown[eager] = LLMEngine(config, tokenizer=smollm2_tokenizer).settings()["fused_decode"]
    if not shown[False]:
        pytest.skip("this CPU has no AVX-512 strips")
    assert shown == {False: True, True: False}
