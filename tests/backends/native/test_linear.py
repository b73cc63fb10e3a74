"""Linear layers repacked for oneDNN compute what F.linear computes, and give the weight memory back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backends.native.linear import Linear, can_pack

pytestmark = pytest.mark.skipif(not can_pack(torch.float32, torch.device("cpu")), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_equals_f_linear(dtype, tol, bias, rows):
    if not can_pack(dtype, torch.device("cpu")):
        pytest.skip(f"no native {dtype} matmuls on this CPU")
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.pack()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 160)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_packing_drops_the_original_weight_unless_asked_to_keep_it():
    dropped, kept = Linear(32, 48, bias=False), Linear(32, 48, bias=False)
    original = kept.weight
    dropped.pack()
    kept.pack(keep_weight=True)
    assert dropped.weight.numel() == 0
    assert kept.weight is original  # a weight tied to the embedding table stays readable


def test_only_cpu_fp32_and_native_bf16_are_packed():
    assert can_pack(torch.float32, torch.device("cpu"))
    assert not can_pack(torch.float16, torch.device("cpu"))
    assert not can_pack(torch.float32, torch.device("meta"))
