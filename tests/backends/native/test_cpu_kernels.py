"""The C kernels are built once per machine into a cache directory; without a compiler, or when the
build fails, the engine keeps its pure-torch paths; loading them leaves the process's floating-point
mode alone."""

from __future__ import annotations

import logging

import pytest
import torch

from backends.native import cpu_kernels
from backends.native.attention import choose_kernels
from backends.native.attention.torch_attention import TorchAttention
from backends.native.config import ModelConfig
from backends.native.layer_ops import TorchLayerOps


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """An empty kernel cache directory, and ``load()`` asked again (its result is cached per process)."""
    monkeypatch.setenv("BURSTGATE_CACHE_DIR", str(tmp_path))
    cpu_kernels.load.cache_clear()
    yield tmp_path
    cpu_kernels.load.cache_clear()


def test_without_a_compiler_the_engine_keeps_the_torch_paths(monkeypatch, fresh_cache, caplog):
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels.load() is None
    assert "no C compiler" in caplog.text
    cfg = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    kernels = choose_kernels("auto", cfg, torch.float32, torch.device("cpu"), 16, 8)
    assert isinstance(kernels.attention, TorchAttention) and kernels.layer_ops is TorchLayerOps


def test_a_failing_build_is_logged_and_falls_back(monkeypatch, fresh_cache, caplog):
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: "/bin/false")
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels.load() is None
    assert "build failed" in caplog.text
    assert not list(fresh_cache.glob("*.so"))  # nothing half-built left to load later


def test_every_source_is_built_once_into_one_library(fresh_cache):
    lib = cpu_kernels.load()
    assert lib is not None
    for name in cpu_kernels.SIGNATURES:  # each declared function comes from some csrc/*.c
        assert getattr(lib, name).restype is cpu_kernels.i32
    built = list(fresh_cache.glob("kernels-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    cpu_kernels.load.cache_clear()
    assert cpu_kernels.load() is not None  # a second process would find it: no rebuild
    assert built[0].stat().st_mtime_ns == mtime


def test_loading_the_kernels_leaves_the_process_floating_point_mode_alone():
    # A library linked with -ffast-math would switch on flush-to-zero for everyone at load time.
    assert cpu_kernels.load() is not None
    assert 5e-324 * 1.0 > 0.0  # subnormals survive
    assert torch.tensor(1e-40, dtype=torch.float32).mul(1.0).item() > 0.0
