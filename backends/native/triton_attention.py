"""Paged decode attention as a Triton kernel, for CUDA (imported only when a decode batch is on a GPU).

Split-KV ("flash-decoding"): one program per (sequence, KV head, split of the context). It loads the
query heads of its KV group together, as the rows of one matrix, so every K/V block read from the
paged cache serves the whole group; it keeps a running max / sum / accumulator (online softmax) over
its blocks. A short torch reduction merges the splits with their log-sum-exp weights. Reads the same
head-major cache ``[num_kv_heads, num_blocks, block_size, head_dim]`` and block tables as the CPU path.

Tested on CPU under Triton's interpreter (TRITON_INTERPRET=1) against the pure-torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCKS_PER_SPLIT = 16  # KV blocks one program walks: 256 tokens at block size 16


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr, scale,
                  stride_qb, stride_qh, stride_kh, stride_kb, stride_ks, stride_tb, num_splits,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context = tl.load(lens_ptr + seq)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    slots = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * stride_qb + (kv_head * GROUP + rows)[:, None] * stride_qh + dims[None, :],
                mask=(rows < GROUP)[:, None], other=0.0).to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for i in range(BLOCKS_PER_SPLIT):
        block = split * BLOCKS_PER_SPLIT + i
        if block * BLOCK_SIZE < context:
            physical = tl.load(tables_ptr + seq * stride_tb + block)
            valid = block * BLOCK_SIZE + slots < context
            offsets = kv_head * stride_kh + physical * stride_kb + slots[:, None] * stride_ks + dims[None, :]
            k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k)) * scale  # [GROUP_PAD, BLOCK_SIZE]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
    out = (seq * tl.num_programs(1) + kv_head) * num_splits + split
    tl.store(m_ptr + out * GROUP_PAD + rows, m_i)
    tl.store(l_ptr + out * GROUP_PAD + rows, l_i)
    tl.store(acc_ptr + (out * GROUP_PAD + rows)[:, None] * HEAD_DIM + dims[None, :], acc)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention output [B, Hq, D] for one new query token per sequence.

    ``q`` [B, Hq, D]; caches [Hkv, num_blocks, block_size, D]; ``block_tables`` [B, max_blocks] and
    ``context_lens`` [B] (int32/int64) on the same device.
    """
    b, hq, d = q.shape
    hkv, _, block_size, _ = k_cache.shape
    group = hq // hkv
    group_pad = max(16, triton.next_power_of_2(group))  # tl.dot wants at least 16 rows
    num_splits = triton.cdiv(block_tables.shape[1], BLOCKS_PER_SPLIT)
    q = q.contiguous()
    m = torch.empty(b, hkv, num_splits, group_pad, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(b, hkv, num_splits, group_pad, d, dtype=torch.float32, device=q.device)
    _split_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, m, l, acc, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_splits, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_SIZE=block_size,
        BLOCKS_PER_SPLIT=BLOCKS_PER_SPLIT)
    # Merge the splits: each one's partial sums, rescaled to the global max.
    weights = torch.exp(m - m.amax(dim=2, keepdim=True))  # splits with no tokens weigh exp(-inf) = 0
    total = (l * weights).sum(dim=2)
    out = (acc * weights[..., None]).sum(dim=2) / total[..., None]
    return out[:, :, :group].reshape(b, hq, d).to(q.dtype)
