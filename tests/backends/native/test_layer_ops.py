"""The C layer ops compute what the torch reference computes (HF Llama's rounding in bf16), in place
where their contract says so, for fp32 and bf16 and for awkward values."""

from __future__ import annotations

import pytest
import torch

from backends.native.layer_ops import CpuLayerOps, TorchLayerOps
from backends.native.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]
# bf16: both sides round at the same points, but the fp32 arithmetic before a rounding may differ by
# an ulp, which can flip a rounded value by one bf16 ulp (2^-8 relative); two roundings, two ulps.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2 ** -6)}

pytestmark = pytest.mark.skipif(not CpuLayerOps.available(torch.float32, torch.device("cpu")),
                                reason="no C compiler here")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_torch_and_updates_the_residual_in_place(dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    residual = torch.randn(37, 576, generator=gen).to(dtype) if with_residual else None
    weight = torch.rand(576, generator=gen).to(dtype) + 0.5
    want_out, want_residual = TorchLayerOps.add_rms_norm(x.clone(), None if residual is None else residual.clone(),
                                                         weight, 1e-5)
    got_out, got_residual = CpuLayerOps.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(got_out, want_out, **TOLERANCE[dtype])
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)  # one rounded add: exact
    if with_residual:
        assert got_residual.data_ptr() == residual.data_ptr() and got_out.data_ptr() == x.data_ptr()
    else:
        assert got_residual is x and got_out.data_ptr() != x.data_ptr()  # x is the next residual: kept


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch_including_extreme_gates(dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(19, 2 * 1536, generator=gen) * 4).to(dtype)
    x[0, :6] = torch.tensor([-1e4, -100.0, -88.0, 88.0, 100.0, 1e4])  # exp over- and underflow in silu
    x[0, 1536:1542] = 1.0
    got = CpuLayerOps.silu_and_mul(x)
    torch.testing.assert_close(got, TorchLayerOps.silu_and_mul(x), **TOLERANCE[dtype])
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_rotary_store_kv_matches_torch_and_fills_the_same_cache_slots(dtype, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(2)
    tokens, num_blocks, block_size = 23, 8, 16
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    cos, sin = RotaryEmbedding(head_dim, 4096, 10000.0, None).tables(positions)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    caches = {ops: [torch.zeros(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype) for _ in range(2)]
              for ops in (TorchLayerOps, CpuLayerOps)}
    want = TorchLayerOps.rotary_store_kv(qkv.clone(), num_heads, num_kv_heads, cos, sin, *caches[TorchLayerOps],
                                         slots)
    got = CpuLayerOps.rotary_store_kv(qkv, num_heads, num_kv_heads, cos, sin, *caches[CpuLayerOps], slots)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOLERANCE[dtype])
    for g, w in zip(caches[CpuLayerOps], caches[TorchLayerOps]):
        torch.testing.assert_close(g, w, **TOLERANCE[dtype])
        assert (g.view(num_kv_heads, -1, head_dim)[:, slots] != 0).all()  # every token landed in its slot
    assert got[0].data_ptr() == qkv.data_ptr()  # q is a view of qkv, rotated in place
