"""The C kernels are built once per machine into a cache directory; where nothing can be built (no
compiler, or a cache that is not writable) a library prebuilt for a portable x86-64 level is loaded;
with neither the engine keeps its pure-torch paths, and says so; loading them leaves the process's
floating-point mode alone."""

from __future__ import annotations

import logging
import platform
import subprocess
import sys

import pytest
import torch

from backends.native import cpu_kernels
from backends.native.attention import choose_kernels, cpu_attention
from backends.native.attention.torch_attention import TorchAttention
from backends.native.config import ModelConfig
from backends.native.layer_ops import CpuLayerOps, TorchLayerOps

x86_64 = pytest.mark.skipif(platform.machine() != "x86_64", reason="portable builds are for x86-64 levels")


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """An empty kernel cache directory, and ``load()`` asked again (its result is cached per process)."""
    monkeypatch.setenv("BURSTGATE_CACHE_DIR", str(tmp_path))
    cpu_kernels.load.cache_clear()
    yield tmp_path
    cpu_kernels.load.cache_clear()


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """Libraries for x86-64-v2 and -v4, built by the command the Dockerfile runs."""
    directory = tmp_path_factory.mktemp("prebuilt")
    out = subprocess.run([sys.executable, "-m", "backends.native.cpu_kernels", "--build", str(directory),
                          "--march", "x86-64-v2", "--march", "x86-64-v4"], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(directory / cpu_kernels.prebuilt_name(m)) for m in ("x86-64-v2", "x86-64-v4")]
    return directory


def test_without_a_compiler_or_prebuilt_kernels_the_engine_keeps_the_torch_paths_and_says_why(
        monkeypatch, fresh_cache, caplog):
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    monkeypatch.delenv("BURSTGATE_KERNELS_DIR", raising=False)
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels.load() is None
    assert "NOT AVAILABLE" in caplog.text and "no C compiler" in caplog.text
    assert "BURSTGATE_KERNELS_DIR is not set" in caplog.text
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


@x86_64
def test_without_a_compiler_the_highest_prebuilt_level_this_cpu_runs_is_loaded(monkeypatch, fresh_cache, prebuilt,
                                                                                 caplog):
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: cpu_kernels.LEVELS["x86-64-v3"])  # no AVX-512
    monkeypatch.setenv("BURSTGATE_KERNELS_DIR", str(prebuilt))
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        lib = cpu_kernels.load()
    assert lib is not None and lib._name == str(prebuilt / cpu_kernels.prebuilt_name("x86-64-v2"))
    assert "prebuilt for x86-64-v2 (no C compiler found)" in caplog.text
    x = torch.randn(3, 64)
    torch.testing.assert_close(CpuLayerOps.silu_and_mul(x), TorchLayerOps.silu_and_mul(x))  # it computes


@x86_64
@pytest.mark.skipif("avx512f" not in cpu_kernels._cpu_flags(), reason="x86-64-v4 needs AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prebuilt_avx512_library_decodes_as_this_cpus_own_build(monkeypatch, fresh_cache, prebuilt, dtype):
    # x86-64-v4 has AVX-512 but not AVX512-BF16: its decode kernel widens bf16 keys where a native build
    # on a CPU with AVX512-BF16 multiplies them in pairs; both must give the same attention.
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(3, 40, 16, 64).to(dtype), torch.randn(3, 40, 16, 64).to(dtype)
    q, tables = torch.randn(5, 9, 64).to(dtype), torch.randperm(40)[:35].view(5, 7)
    lens = torch.tensor([1, 16, 17, 100, 112])

    def decode():
        return cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125).float()

    native = decode()
    cpu_kernels.load.cache_clear()
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: cpu_kernels.LEVELS["x86-64-v4"])
    monkeypatch.setenv("BURSTGATE_KERNELS_DIR", str(prebuilt))
    assert cpu_kernels.load()._name == str(prebuilt / cpu_kernels.prebuilt_name("x86-64-v4"))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output apart at most
    torch.testing.assert_close(decode(), native, atol=tolerance, rtol=tolerance)


@x86_64
def test_an_unwritable_cache_falls_back_to_the_prebuilt_library(monkeypatch, fresh_cache, prebuilt, caplog):
    blocker = fresh_cache / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("BURSTGATE_CACHE_DIR", str(blocker / "cache"))  # cannot be created: as a read-only root
    monkeypatch.setenv("BURSTGATE_KERNELS_DIR", str(prebuilt))
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is not None
    assert "prebuilt for x86-64-" in caplog.text and "build failed" in caplog.text


@x86_64
def test_prebuilt_kernels_for_levels_this_cpu_lacks_are_never_loaded(monkeypatch, fresh_cache, prebuilt, caplog):
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"sse2"})  # below x86-64-v2
    monkeypatch.setenv("BURSTGATE_KERNELS_DIR", str(prebuilt))
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels.load() is None
    assert f"none for this CPU's levels (none) in {prebuilt}" in caplog.text


def test_an_unknown_level_is_refused_before_anything_is_built(tmp_path):
    with pytest.raises(ValueError, match="x86-64-v9"):
        cpu_kernels.build_portable(tmp_path, ["x86-64-v2", "x86-64-v9"])
    assert not list(tmp_path.iterdir())
