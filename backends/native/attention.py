"""Paged attention over the flat batch: decodes and prefill chunks whose new keys/values are in the cache.

KV caches are head-major, ``[num_kv_heads, num_blocks, block_size, head_dim]`` per layer, so a gather of
the rows ``h * num_blocks + block`` yields ``[..., kv_head, tokens, head_dim]`` already contiguous: one
memcpy-like ``index_select`` per cache and no transpose copy (the gather dominated CPU decode).

Decodes go to a paged kernel that reads the cache in place when the model runner has one: the C
kernel of cpu_attention.py on CPU, the Triton kernel of triton_attention.py on CUDA; on CPU prefill
chunks go to cpu_attention.py's causal kernel the same way. The pure-torch
path (the reference, and the fallback without a C compiler) batches decodes in groups of similar
context length: gather their blocks, pad to the group's longest, mask, and attend with the query heads
of each KV group stacked (one K/V read serves the group); plain matmuls beat SDPA there (SDPA with a
mask is 10x slower in bf16 on CPU). Each prefill chunk attends to its cached prefix plus its own tokens
with a bottom-right-aligned causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.native.batch import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values [T, Hkv, D] into the caches [Hkv, num_blocks, block_size, D]."""
    h, _, _, d = k_cache.shape
    k_cache.view(h, -1, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(h, -1, d).index_copy_(1, slot_mapping, v.transpose(0, 1))


def gather_rows(block_tables: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Row ids into a cache viewed as [Hkv * num_blocks, block_size * D], ordered (sequence, head, block)."""
    heads = torch.arange(num_kv_heads, device=block_tables.device).view(1, num_kv_heads, 1) * num_blocks
    return (heads + block_tables.view(block_tables.shape[0], 1, -1)).flatten()


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention output [T, Hq, D] for queries ``q`` [T, Hq, D]; their keys/values ``k``/``v`` [T, Hkv, D]
    are stored in the caches already (``write_kv``)."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd and meta.decode_tables is not None:  # a paged kernel reads the cache in place
        kernel = _paged_decode_kernel(q.device)
        out[:nd] = kernel(q[:nd], k_cache, v_cache, meta.decode_tables, meta.decode_context_lens, scale)
    elif nd:
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta, scale)
    if meta.prefill_tables is not None:  # the C prefill kernel reads prefixes and new keys from the cache
        from backends.native.cpu_attention import paged_prefill_attention

        paged_prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_tables, meta.prefill_query_starts,
                                meta.prefill_query_lens, meta.prefill_context_lens, scale, out=out[nd:])
        return out
    for i in range(nd, len(meta.query_lens)):
        start, qlen, ctx = meta.query_starts[i], meta.query_lens[i], meta.context_lens[i]
        rows = slice(start, start + qlen)
        if ctx == qlen:  # no cached prefix: the fresh keys are all there is
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            keys = _gather(k_cache, meta.block_tables[i])[0, :, :ctx]
            values = _gather(v_cache, meta.block_tables[i])[0, :, :ctx]
        out[rows] = _prefill_attention(q[rows].transpose(0, 1), keys, values, scale).transpose(0, 1)
    return out


def _paged_decode_kernel(device: torch.device):
    # Imported here: CPU installs need no Triton, and the C kernel is built only when first used.
    if device.type == "cuda":
        from backends.native.triton_attention import paged_decode_attention
    else:
        from backends.native.cpu_attention import paged_decode_attention
    return paged_decode_attention


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Hkv, blocks * block_size, D] for block tables [B, blocks] (or one table [blocks])."""
    h, nb, bs, d = cache.shape
    tables = block_tables.view(-1, block_tables.shape[-1])
    rows = gather_rows(tables, h, nb)
    flat = cache.view(h * nb, bs * d)
    if out is None:
        return flat.index_select(0, rows).view(tables.shape[0], h, -1, d)
    torch.index_select(flat, 0, rows, out=out.view(rows.shape[0], bs * d))
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    b, hq, d = q.shape
    hkv = k_cache.shape[0]
    grouped = q.view(b, hkv, hq // hkv, d)  # query heads of one KV head, side by side
    out = torch.empty_like(grouped)
    for g in meta.decode_groups:
        shape = (g.end - g.start, hkv, g.block_tables.shape[1] * k_cache.shape[2], d)
        keys, values = meta.workspace.tensors(shape, 2, k_cache.dtype, k_cache.device)
        _gather(k_cache, g.block_tables, keys)  # [n, Hkv, L, D]
        _gather(v_cache, g.block_tables, values)
        scores = torch.matmul(grouped[g.start:g.end], keys.transpose(-1, -2)) * scale  # [n, Hkv, G, L]
        scores = scores.masked_fill_(~g.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        torch.matmul(probs, values, out=out[g.start:g.end])
    return out.view(b, hq, d)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` [Hq, Q, D] over ``k``/``v`` [Hkv, C, D] where the queries are the last Q."""
    qlen, ctx = q.shape[1], k.shape[1]
    mask = None
    if ctx != qlen:
        # SDPA's is_causal aligns top-left; with a cached prefix the queries sit at the bottom-right.
        mask = torch.ones(qlen, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - qlen)
    # 4-D inputs: with 3-D ones SDPA falls back to its math path on CPU (2-3x slower than flash).
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=True)[0]
