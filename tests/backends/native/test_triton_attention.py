"""The Triton paged decode kernel (the CUDA path), run on CPU under Triton's interpreter and checked
against plain softmax attention over each sequence's gathered blocks."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is decorated: run on CPU tensors
pytest.importorskip("triton", reason="Triton is not installed (dev extra on Linux x86_64)")
if os.environ["TRITON_INTERPRET"] != "1" and not torch.cuda.is_available():
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from backends.native.triton_attention import BLOCKS_PER_SPLIT, paged_decode_attention  # noqa: E402


def reference(q, k_cache, v_cache, tables, lens, scale):
    hkv, _, bs, d = k_cache.shape
    out = []
    for i, ctx in enumerate(lens.tolist()):
        blocks = tables[i, : (ctx + bs - 1) // bs]
        k = k_cache[:, blocks].reshape(hkv, -1, d)[:, :ctx].float()
        v = v_cache[:, blocks].reshape(hkv, -1, d)[:, :ctx].float()
        group = q.shape[1] // hkv
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        probs = torch.softmax((q[i].float()[:, None, :] @ k.transpose(1, 2)).squeeze(1) * scale, dim=-1)
        out.append((probs[:, None, :] @ v).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("hq, hkv, d", [(4, 4, 32), (9, 3, 64), (8, 2, 128)])
def test_kernel_matches_softmax_attention_over_the_paged_cache(hq, hkv, d):
    torch.manual_seed(0)
    bs, num_blocks = 16, 64
    lens = torch.tensor([1, 15, 16, 17, 100, BLOCKS_PER_SPLIT * bs + 5])  # ragged, one spans two splits
    max_blocks = (int(lens.max()) + bs - 1) // bs
    k_cache = torch.randn(hkv, num_blocks, bs, d)
    v_cache = torch.randn(hkv, num_blocks, bs, d)
    tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in lens])  # scattered blocks
    q = torch.randn(len(lens), hq, d)
    scale = d ** -0.5
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert got.shape == q.shape
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, lens, scale), atol=1e-4, rtol=1e-4)
