"""The C kernels take the layouts their fixed buffers hold and refuse the rest, by ``supports`` before
use and by a clear error if called anyway (the backends' numbers are checked in test_backends.py)."""

from __future__ import annotations

import pytest
import torch

from backends.native.attention import cpu_attention


def test_c_kernels_refuse_layouts_beyond_their_buffers():
    assert cpu_attention.supports(torch.float32, 9, 3, 64, 16)
    assert cpu_attention.supports(torch.bfloat16, 40, 8, 128, 16)
    assert not cpu_attention.supports(torch.float32, 32, 1, 64, 16)  # 32 query heads per KV head
    assert not cpu_attention.supports(torch.float32, 8, 8, 512, 16)  # head_dim 512
    assert not cpu_attention.supports(torch.float16, 9, 3, 64, 16)  # a storage type they do not read
    k_cache = v_cache = torch.zeros(1, 4, 16, 32)
    tables, lens = torch.zeros(2, 1, dtype=torch.int64), torch.tensor([3, 5])
    with pytest.raises(ValueError, match="unsupported layout"):
        cpu_attention.paged_decode_attention(torch.randn(2, 32, 32), k_cache, v_cache, tables, lens, 0.1)
