"""Paged attention as one Triton kernel for CUDA: prefill chunks and decodes of a step in one launch.

One program per (tile of query tokens of one sequence, KV head). A tile's rows are its query tokens ×
the query heads of the KV group (GQA), so every K/V tile read from the paged cache serves the whole
group. Keys are walked in tiles of ``BLOCK_N`` tokens through the block table, causally (a query at
absolute position p sees keys 0..p; a chunk's queries are the last ``query_len`` of its ``context_len``
positions, after any cached prefix), with an online softmax. The program finds its sequence by binary
search over the query starts, so the grid depends only on the token and sequence counts: a decode step
of a given batch size launches the same grid every time (CUDA graphs capture it once).

The layout is the engine's head-major cache ``[num_kv_heads, num_blocks, block_size, head_dim]``, the
same one the CPU kernels read. Tested on CPU under Triton's interpreter (TRITON_INTERPRET=1) and on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _find_sequence(query_starts_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first tile (``query_start // BLOCK_Q + index``) is at or before ``tile``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_starts_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, query_starts_ptr, context_lens_ptr, scale, num_seqs,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_kb, stride_ks, stride_tb,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_starts_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_starts_ptr + seq)
    q_len = tl.load(query_starts_ptr + seq + 1) - q_start
    first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # this tile's first query, counted in its sequence
    if first >= q_len:
        return  # a spare program: the grid has one tile per sequence more than the tokens need
    context = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_idx = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    valid = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    position = context - q_len + q_idx  # absolute position of each row's query
    q = tl.load(q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=valid[:, None], other=0.0)

    # Finite start: rows with nothing visible yet keep exp() arguments finite (no inf - inf).
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_end = context - q_len + tl.minimum(q_len, first + BLOCK_Q)  # one past the last key any row sees
    keys = tl.arange(0, BLOCK_N)
    # 64-bit cache offsets: one layer's cache passes 2**31 elements when a small model gets a large GPU's memory
    head_offset = kv_head.to(tl.int64) * stride_kh
    for start in range(0, kv_end, BLOCK_N):
        key = start + keys
        in_range = key < kv_end
        block = tl.load(tables_ptr + seq * stride_tb + key // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        offsets = head_offset + block[:, None] * stride_kb + (key % BLOCK_SIZE)[:, None] * stride_ks + dims[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=in_range[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=in_range[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        visible = in_range[None, :] & (key[None, :] <= position[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_starts: torch.Tensor, context_lens: torch.Tensor, scale: float, max_query_len: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention [T, Hq, D] for the queries ``q`` [T, Hq, D] of ``n`` sequences.

    Sequence ``i`` owns rows ``query_starts[i]:query_starts[i + 1]`` ([n + 1]); they are the last of its
    ``context_lens[i]`` positions, whose keys/values are in the caches [Hkv, num_blocks, block_size, D]
    at the blocks of ``block_tables[i]`` ([n, max_blocks]). Integer tensors int32 or int64, on q's device.
    ``max_query_len`` only picks the tile shape (1: a decode-only step).
    """
    t, hq, d = q.shape
    hkv, _, block_size, _ = k_cache.shape
    group = hq // hkv
    num_seqs = context_lens.shape[0]
    block_m = max(16, triton.next_power_of_2(group))  # tl.dot wants 16 rows at least
    if max_query_len > 1:
        block_m = max(block_m, 64)  # prefill: more queries share each K/V tile
    block_q = block_m // group
    out = torch.empty_like(q) if out is None else out
    grid = (t // block_q + num_seqs, hkv)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_starts, context_lens, scale, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=d, BLOCK_SIZE=block_size,
        BLOCK_N=64 if max_query_len > 1 else 32, PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out
