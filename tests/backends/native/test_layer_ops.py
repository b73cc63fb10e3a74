"""The C and Triton layer ops compute what the torch reference computes (HF Llama's rounding in bf16), in
place where their contract says so, for fp32 and bf16 and for awkward values. Triton runs on a GPU, or
on CPU under its interpreter (fp32 there: the interpreter has no bf16 arithmetic)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():  # before the Triton kernels are decorated: run them on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

from backends.native.layer_ops import CpuLayerOps, TorchLayerOps
from backends.native.rotary import RotaryEmbedding

# bf16: both sides round at the same points, but the fp32 arithmetic before a rounding may differ by
# an ulp, which can flip a rounded value by one bf16 ulp (2^-8 relative); two roundings, two ulps.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2 ** -6)}
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None and (GPU or os.environ.get("TRITON_INTERPRET") == "1")


def _triton_ops():
    from backends.native.triton_layer_ops import TritonLayerOps

    return TritonLayerOps


def _cases():
    """(ops, device, dtype) for every implementation that can run here."""
    no_c = not CpuLayerOps.available(torch.float32, torch.device("cpu"))
    for dtype in (torch.float32, torch.bfloat16):
        yield pytest.param("C", "cpu", dtype, marks=pytest.mark.skipif(no_c, reason="no C compiler here"),
                           id=f"C-{dtype}".replace("torch.", ""))
        runs = HAS_TRITON and (GPU or dtype == torch.float32)
        yield pytest.param("Triton", "cuda" if GPU else "cpu", dtype, id=f"Triton-{dtype}".replace("torch.", ""),
                           marks=pytest.mark.skipif(not runs, reason="Triton: a GPU, or fp32 under the interpreter"))


CASES = list(_cases())


def _ops(name: str):
    return CpuLayerOps if name == "C" else _triton_ops()


@pytest.mark.parametrize("ops, device, dtype", CASES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_torch_and_updates_the_residual_in_place(ops, device, dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=gen) * 3).to(dtype).to(device)
    residual = torch.randn(37, 576, generator=gen).to(dtype).to(device) if with_residual else None
    weight = (torch.rand(576, generator=gen).to(dtype) + 0.5).to(device)
    want_out, want_residual = TorchLayerOps.add_rms_norm(x.clone(), None if residual is None else residual.clone(),
                                                         weight, 1e-5)
    got_out, got_residual = _ops(ops).add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(got_out, want_out, **TOLERANCE[dtype])
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)  # one rounded add: exact
    if with_residual:
        assert got_residual.data_ptr() == residual.data_ptr() and got_out.data_ptr() == x.data_ptr()
    else:
        assert got_residual is x and got_out.data_ptr() != x.data_ptr()  # x is the next residual: kept


@pytest.mark.parametrize("ops, device, dtype", CASES)
def test_silu_and_mul_matches_torch_including_extreme_gates(ops, device, dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(19, 2 * 1536, generator=gen) * 4).to(dtype)
    x[0, :6] = torch.tensor([-1e4, -100.0, -88.0, 88.0, 100.0, 1e4])  # exp over- and underflow in silu
    x[0, 1536:1542] = 1.0
    x = x.to(device)
    got = _ops(ops).silu_and_mul(x)
    torch.testing.assert_close(got, TorchLayerOps.silu_and_mul(x), **TOLERANCE[dtype])
    assert torch.isfinite(got).all()


def test_bf16_rows_of_a_width_off_the_vectors_take_the_scalar_loops_and_agree_as_well():
    # norms of rows of multiples of 32 values and SiLU of multiples of 16 take the AVX512-BF16 paths; 40 takes
    # the scalar loops
    if not CpuLayerOps.available(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(2)
    x, residual = ((torch.randn(7, 40, generator=gen) * 3).bfloat16() for _ in range(2))
    weight = (torch.rand(40, generator=gen) + 0.5).bfloat16()
    want = TorchLayerOps.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    for got, expected in zip(CpuLayerOps.add_rms_norm(x, residual, weight, 1e-5), want):
        torch.testing.assert_close(got, expected, **TOLERANCE[torch.bfloat16])
    both = (torch.randn(7, 80, generator=gen) * 4).bfloat16()
    torch.testing.assert_close(CpuLayerOps.silu_and_mul(both), TorchLayerOps.silu_and_mul(both),
                               **TOLERANCE[torch.bfloat16])


def test_bf16_silu_and_mul_is_torchs_bit_for_bit_on_every_gate():
    # Every bf16 gate but NaNs and denormals (and +-inf), up 1 and 3: where the C kernel's vector silu rounds, it
    # rounds as torch's (the scalar loop with libmvec's expf did not on 0.08% of gates; a division turned into a
    # reciprocal product by -ffast-math flipped a midpoint at 5.9375). The AVX512-BF16 conversions flush denormals
    # to zero, as oneDNN's bf16 kernels do: gates under 2^-125 (silu ~ gate / 2 there) are left out.
    if not CpuLayerOps.available(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no C compiler here")
    gates = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = gates[~torch.isnan(gates) & ((gates.abs() >= 2 * torch.finfo(torch.bfloat16).tiny) | (gates == 0))]
    gates = gates[: len(gates) // 16 * 16]  # whole vectors, as the model's widths are
    for up in (1.0, 3.0):
        x = torch.cat([gates, torch.full_like(gates, up)]).view(1, -1)
        torch.testing.assert_close(CpuLayerOps.silu_and_mul(x), TorchLayerOps.silu_and_mul(x), atol=0, rtol=0,
                                   equal_nan=True)  # silu(-inf): NaN in both


@pytest.mark.parametrize("ops, device, dtype", CASES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_rotary_store_kv_matches_torch_and_fills_the_same_cache_slots(ops, device, dtype, num_heads, num_kv_heads,
                                                                      head_dim):
    gen = torch.Generator().manual_seed(2)
    tokens, num_blocks, block_size = 23, 8, 16
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype).to(device)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    cos, sin = RotaryEmbedding(head_dim, 4096, 10000.0, None, device).tables(positions.to(device))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(device)
    caches = {impl: [torch.zeros(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device)
                     for _ in range(2)] for impl in ("torch", ops)}
    want = TorchLayerOps.rotary_store_kv(qkv.clone(), num_heads, num_kv_heads, cos, sin, *caches["torch"], slots)
    got = _ops(ops).rotary_store_kv(qkv, num_heads, num_kv_heads, cos, sin, *caches[ops], slots)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOLERANCE[dtype])
    for g, w in zip(caches[ops], caches["torch"]):
        torch.testing.assert_close(g, w, **TOLERANCE[dtype])
        assert (g.view(num_kv_heads, -1, head_dim)[:, slots] != 0).all()  # every token landed in its slot
    assert got[0].data_ptr() == qkv.data_ptr()  # q is a view of qkv, rotated in place


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.skipif(not CpuLayerOps.available(torch.float32, torch.device("cpu")), reason="no C compiler here")
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 40], ids=["vectors", "vectors-and-scalar-tail"])
def test_rotary_store_kv_rounds_into_an_fp8_cache_bit_for_bit_as_the_torch_reference(dtype, cache_dtype, d):
    # Every finite bf16 value (as keys and values), and in fp32 random values across fp8's range, its subnormals
    # and ties, past its largest finite value (saturated, as vLLM's conversions do) and infinities; a rotation by
    # 0 (cos 1, sin 0) leaves the keys as they are, so both caches hold exactly the rounded inputs. Rows of 40
    # values end in 8 the kernel rounds one by one (16 at a time before them)
    if dtype == torch.bfloat16:
        x = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        x = x[x.isfinite()]
    else:
        torch.manual_seed(0)
        x = torch.randn(60_000) * torch.logspace(-12, 6, 60_000) * torch.tensor([-1.0, 1.0]).repeat(30_000)
        steps = 2.0 ** torch.arange(-20, 17).float()  # values halfway between fp8 neighbours round to even
        x = torch.cat([x, steps * 1.0625, steps * 1.125, steps * 1.1875, steps * 1.25, torch.tensor([
            float("inf"), -float("inf"), 448.0, 464.0, 480.0, 57344.0, 61440.0, 1e30, -1e30, 0.0, -0.0])])
    hkv = 1
    x = x[:len(x) // d * d].view(-1, d)
    tokens = len(x)
    qkv = torch.cat([x, x, x], dim=1).to(dtype)  # one query head, one key head, one value head
    cos, sin = torch.ones(tokens, 1, d // 2), torch.zeros(tokens, 1, d // 2)
    slots = torch.randperm(tokens)
    caches = {}
    for ops in (TorchLayerOps, CpuLayerOps):
        k_cache, v_cache = (torch.zeros(hkv, tokens, 1, d, dtype=cache_dtype) for _ in range(2))
        ops.rotary_store_kv(qkv.clone(), 1, hkv, cos, sin, k_cache, v_cache, slots)
        caches[ops.name] = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    assert torch.equal(caches["C"][0], caches["torch"][0]) and torch.equal(caches["C"][1], caches["torch"][1])
    stored = caches["C"][0].view(cache_dtype).view(tokens, d)[slots].float()  # token t went to slot slots[t]
    largest = torch.finfo(cache_dtype).max
    assert stored.isfinite().all() and torch.equal(stored, x.to(dtype).float().clamp(-largest, largest).to(
        cache_dtype).float())
