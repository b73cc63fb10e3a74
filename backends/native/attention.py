"""Paged attention over the flat batch: KV write, then attention for decodes and prefill chunks.

The CPU path is plain PyTorch: decodes are batched (gather their blocks, pad, mask, one SDPA call);
each prefill chunk attends to its cached prefix plus its own tokens with a bottom-right-aligned causal
mask. On CUDA the decode part runs the Triton split-KV kernel in ``triton_attention.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.native.batch import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values [T, Hkv, D] into the paged caches [num_blocks, block_size, Hkv, D]."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention output [T, Hq, D] for queries ``q`` [T, Hq, D] whose ``k``/``v`` [T, Hkv, D] are new."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        if q.is_cuda:
            from backends.native.triton_attention import paged_decode_attention

            out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                              meta.decode_context_lens, scale)
        else:
            out[:nd] = _decode_attention_torch(q[:nd], k_cache, v_cache, meta, scale)
    for i in range(nd, len(meta.query_lens)):
        start, qlen, ctx = meta.query_starts[i], meta.query_lens[i], meta.context_lens[i]
        rows = slice(start, start + qlen)
        if ctx == qlen:  # no cached prefix: the fresh keys are all there is
            keys, values = k[rows], v[rows]
        else:
            keys = _gather(k_cache, meta.block_tables[i], ctx)
            values = _gather(v_cache, meta.block_tables[i], ctx)
        out[rows] = _prefill_attention(q[rows], keys, values, scale)
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    return cache[block_table].flatten(0, 1)[:length]


def _decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    tables = meta.decode_block_tables
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[tables].flatten(1, 2).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` [Q, Hq, D] over ``k``/``v`` [C, Hkv, D] where the queries are the last Q."""
    qlen, ctx = q.shape[0], k.shape[0]
    mask = None
    if ctx != qlen:
        # SDPA's is_causal aligns top-left; with a cached prefix the queries sit at the bottom-right.
        mask = torch.ones(qlen, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - qlen)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
