"""A CPU step runs the whole decoder stack in one C call (fused_step.py) and leaves bit for bit the logits and KV
cache of the eager path, for every kind of small-step copy this CPU has (tiles of bf16 or int8 weights, on AMX or
AVX512-BF16; AVX-512 strips of fp32 ones): decodes, prefill chunks (with and without a cached prefix) and mixes of
both, up to the rows the copies serve; with tile layouts as the weights' only copies (bf16 or int8, AMX), steps of
any size (the tile kernel's blocked path); over KV caches stored as the activations or in fp8. Larger steps and
``enforce_eager`` run eagerly."""

from __future__ import annotations

import json

import pytest
import torch

from backends.native.batch import Batch
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine
from backends.native.linear_kernels import STRIP_ROWS, TILE_ROWS, TILE_STEPS_ANY, tile_steps
from backends.native.model_runner import ModelRunner
from backends.native.weights import open_checkpoint

# Qwen2: q/k/v with biases, which the C path adds after the projection as torch does
TINY_QWEN2 = {"model_type": "qwen2", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": True}
# each kind of copy, and the most rows of the steps it runs fused (None: any; TILES: any on AMX tiles, where the
# tiny model's bf16 and int8 weights have only their tile layouts, else TILE_ROWS)
TILES = "tiles"
COPIES = {"bf16-tiles": (dict(dtype="bfloat16"), TILES),
          "int8-tiles": (dict(dtype="bfloat16", quantization="int8"), TILES),
          "fp32-strips": (dict(dtype="float32"), STRIP_ROWS),
          # fp8 KV caches (kv_cache_dtype), rounded as they are stored and widened as they are read
          "bf16-tiles-fp8-kv": (dict(dtype="bfloat16", kv_cache_dtype="fp8"), TILES),
          "fp32-strips-fp8-e5m2-kv": (dict(dtype="float32", kv_cache_dtype="fp8_e5m2"), STRIP_ROWS)}
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


class Sequences:
    """Sequences on consecutive KV blocks, stepped as the scheduler steps them: decodes first."""

    def __init__(self, lengths: list[int]) -> None:
        self.tables, self.lens, next_block = [], [0] * len(lengths), 0
        for n in lengths:
            self.tables.append(list(range(next_block, next_block + -(-n // BLOCK_SIZE))))
            next_block += len(self.tables[-1])

    def step(self, *work: tuple[int, int, bool]) -> Batch:
        """(sequence, new tokens, sampled) for each sequence of the step, decodes first."""
        ids, positions, slots, query_lens, context_lens, tables, sample = [], [], [], [], [], [], []
        for seq, n, sampled in work:
            for p in range(self.lens[seq], self.lens[seq] + n):
                ids.append(100 * seq + p % 100)
                positions.append(p)
                slots.append(self.tables[seq][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            self.lens[seq] += n
            query_lens.append(n), context_lens.append(self.lens[seq]), tables.append(self.tables[seq])
            sample.append(sampled)
        return Batch(ids, positions, slots, query_lens, context_lens, tables, sample)


def _steps() -> list[Batch]:
    """Prefills, decodes and mixes of both, of 1 to 150 rows: a prefill of three prompts; their decode; their
    decodes beside a new prompt's first chunk; a decode beside that prompt's second chunk (a cached prefix); a
    prefill of 150 rows; decodes of two sequences, one sampled."""
    seqs = Sequences([48, 16, 32, 176, 160])
    return [seqs.step((0, 37, True), (1, 5, True), (2, 16, True)),
            seqs.step((0, 1, True), (1, 1, True), (2, 1, True)),
            seqs.step((0, 1, True), (1, 1, True), (2, 1, True), (3, 100, False)),
            seqs.step((0, 1, True), (3, 60, True)),
            seqs.step((4, 150, True)),
            seqs.step((3, 1, False), (4, 1, True))]


@pytest.mark.parametrize(("fields", "max_rows"), COPIES.values(), ids=COPIES)
def test_a_fused_step_leaves_the_eager_steps_logits_and_kv_cache(tiny_model, fields, max_rows):
    eager, fused = _runner(tiny_model, True, **fields), _runner(tiny_model, False, **fields)
    if fused.fused is None:
        pytest.skip("this CPU has no small-step copies for these weights (tiles, AVX-512 strips)")
    assert eager.fused is None  # enforce_eager: every step through the torch modules
    if max_rows == TILES:
        max_rows = None if tile_steps() == TILE_STEPS_ANY else TILE_ROWS
    assert fused.fused.max_rows == max_rows
    fused_rows, run = [], fused.fused.run
    fused.fused.run = lambda *args: fused_rows.append(len(args[0])) or run(*args)
    steps = _steps()
    for batch in steps:
        expected, got = eager.execute(batch), fused.execute(batch)
        assert got.shape[0] == sum(batch.sample) and torch.equal(got, expected)
    rows = [len(batch.token_ids) for batch in steps]
    assert fused_rows == [n for n in rows if max_rows is None or n <= max_rows]
    for eager_cache, fused_cache in zip(eager.kv_caches, fused.kv_caches):
        for expected, got in zip(eager_cache, fused_cache):  # all but the scratch block the eager padding writes
            assert got.dtype == fused.kv_dtype and torch.equal(got[:, :-1].view(torch.uint8),
                                                               expected[:, :-1].view(torch.uint8))


def test_steps_with_more_rows_than_the_copies_serve_run_eagerly(tiny_model):
    runner = _runner(tiny_model, False, dtype="float32")
    if runner.fused is None:
        pytest.skip("this CPU has no AVX-512 strips")
    assert all(runner.fused.can_run(batch) == (len(batch.token_ids) <= STRIP_ROWS) for batch in _steps())
    n = runner.fused.max_rows + 1
    wide = Batch([1] * n, [0] * n, list(range(n)), [1] * n, [1] * n, [[i] for i in range(n)], [True] * n)
    assert not runner.fused.can_run(wide)


def test_get_info_says_whether_steps_run_fused(tiny_model, smollm2_tokenizer):
    shown = {}
    for eager in (False, True):
        config = EngineConfig(model_path=str(tiny_model), load_format="dummy", device="cpu", dtype="float32",
                              num_blocks=16, warmup=False, enforce_eager=eager)
        shown[eager] = LLMEngine(config, tokenizer=smollm2_tokenizer).settings()["fused_steps"]
    if not shown[False]:
        pytest.skip("this CPU has no AVX-512 strips")
    assert shown == {False: True, True: False}
