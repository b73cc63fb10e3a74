"""On CPU the engine keeps freed memory in the process: once warm, a step's activations reuse memory the
process already has instead of faulting in (and zeroing) fresh pages, step after step."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from backends.native.batch import Batch
from backends.native.config import EngineConfig
from backends.native.host_memory import keep_freed_memory
from backends.native.model_runner import ModelRunner
from backends.native.weights import default_model_path, open_checkpoint

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def _batch(query_lens: list[int], context_lens: list[int], block_size: int) -> Batch:
    """Sequences on consecutive blocks, each computing its last ``query_lens[i]`` of ``context_lens[i]`` positions."""
    tables, token_ids, positions, slots, next_block = [], [], [], [], 0
    for n, ctx in zip(query_lens, context_lens):
        tables.append(list(range(next_block, next_block + -(-ctx // block_size))))
        next_block += len(tables[-1])
        for p in range(ctx - n, ctx):
            token_ids.append(100 + p)
            positions.append(p)
            slots.append(tables[-1][p // block_size] * block_size + p % block_size)
    return Batch(token_ids, positions, slots, query_lens, context_lens, tables, [True] * len(query_lens))


def _faults(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@glibc
def test_glibc_takes_the_setting():
    assert keep_freed_memory()


@glibc
@torch.inference_mode()
def test_warm_steps_fault_in_no_fresh_memory():
    config = EngineConfig(dtype="float32", device="cpu", load_format="dummy", max_model_len=512, num_blocks=160)
    runner = ModelRunner(config, open_checkpoint(default_model_path()), config.max_model_len)
    # prefills of 1024 tokens (MiBs of activations per layer, freed as the step goes) and decodes, alternating
    steps = [_batch([256] * 4, [256] * 4, config.block_size), _batch([1] * 8, [300] * 8, config.block_size)]
    for step in steps * 2:
        runner.execute(step)
    faults = [_faults(lambda: runner.execute(step)) for step in steps * 3]
    page = resource.getpagesize()
    assert max(faults) * page < 4 << 20, f"pages faulted in per warm step: {faults}"
