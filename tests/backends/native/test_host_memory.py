"""On CPU the engine keeps freed memory in the process: once warm, a step's activations reuse memory the
process already has instead of faulting in (and zeroing) fresh pages, step after step. What it may still
take is the machine's available memory, capped by its container's cgroup limit (fake cgroup trees here)."""

from __future__ import annotations

import multiprocessing
import platform
import resource
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace

import psutil
import pytest
import torch

from backends.native.config import EngineConfig
from backends.native.host_memory import available_memory, keep_freed_memory
from backends.native.model_runner import ModelRunner
from backends.native.process import prepare_process
from backends.native.weights import default_model_path, open_checkpoint
from tests.backends.native.reference import prefill_batch

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
GIB = 2**30


@pytest.mark.parametrize("files, expected", [
    ({"memory.max": f"{8 * GIB}", "memory.current": f"{3 * GIB}"}, 5 * GIB),  # v2: the limit leaves less
    ({"memory.max": "max", "memory.current": f"{3 * GIB}"}, 100 * GIB),  # v2 without a limit
    ({"memory.max": f"{500 * GIB}", "memory.current": f"{3 * GIB}"}, 100 * GIB),  # a limit above the machine's
    ({"memory/memory.limit_in_bytes": f"{8 * GIB}", "memory/memory.usage_in_bytes": f"{7 * GIB}"}, 1 * GIB),  # v1
    ({"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "1"}, 100 * GIB),
    ({"memory.max": f"{2 * GIB}", "memory.current": f"{3 * GIB}"}, 0),  # over its limit already
    ({}, 100 * GIB),  # no cgroup files: a process outside a container
])
def test_available_memory_is_the_machines_capped_by_the_cgroup_limit(tmp_path, monkeypatch, files, expected):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=100 * GIB))
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    assert available_memory(tmp_path) == expected


def _faults(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _refault_pages(keep: bool) -> int:
    """Pages faulted in when 16 MiB are allocated, touched and freed, then allocated and touched again, in a
    fresh process told to ``keep`` freed memory or not."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    if keep:
        assert keep_freed_memory()
    size = 16 << 20

    def touch() -> None:
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)

    touch()
    return _faults(touch)


@glibc
def test_freed_memory_stays_in_the_process_once_glibc_takes_the_setting():
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        without = pool.submit(_refault_pages, False).result(timeout=60)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        kept = pool.submit(_refault_pages, True).result(timeout=60)
    page = resource.getpagesize()
    assert without * page >= 8 << 20  # glibc hands a 16 MiB block back to the kernel, and faults it in again
    assert kept * page < 1 << 20  # kept: the second allocation reuses the pages


@torch.inference_mode()
def _warm_step_faults() -> list[int]:
    """Pages faulted in during each of six warm steps of a new runner: steps of 1024 tokens (MiBs of activations
    per layer, freed as the step goes) and of 8, alternating, after two of each."""
    config = EngineConfig(dtype="float32", device="cpu", load_format="dummy", max_model_len=512, num_blocks=160)
    prepare_process(config)
    runner = ModelRunner(config, open_checkpoint(default_model_path()), config.max_model_len)
    steps = [prefill_batch([list(range(100, 356))] * 4, runner.block_size)[0],
             prefill_batch([list(range(100, 108))] * 8, runner.block_size)[0]]
    for step in steps * 2:
        runner.execute(step)
    return [_faults(lambda step=step: runner.execute(step)) for step in steps * 3]


@glibc
def test_warm_steps_fault_in_no_fresh_memory():
    # in a process of its own: the fault counter is the whole process's, and the threads earlier tests leave
    # behind (servers, engines) fault pages of their own while a step runs
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        faults = pool.submit(_warm_step_faults).result(timeout=600)
    page = resource.getpagesize()
    assert max(faults) * page < 4 << 20, f"pages faulted in per warm step: {faults}"
