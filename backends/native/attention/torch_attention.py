"""Paged attention in plain torch: the reference path, and the fallback without compiled kernels.

KV caches are head-major, ``[num_kv_heads, num_blocks, block_size, head_dim]`` per layer, so a gather of
the rows ``h * num_blocks + block`` yields ``[..., kv_head, tokens, head_dim]`` already contiguous: one
memcpy-like ``index_select`` per cache and no transpose copy (the gather dominated CPU decode).

Decodes are batched in groups of similar context length: gather their blocks, pad to the group's
longest, mask, and attend with the query heads of each KV group stacked (one K/V read serves the
group); plain matmuls beat SDPA there (SDPA with a mask is 10x slower in bf16 on CPU). Each prefill
chunk attends to its cached prefix plus its own tokens with a bottom-right-aligned causal mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backends.native.attention.base import AttentionBackend, StepMetadata, pad_tables
from backends.native.batch import Batch

# Padding every decode to the batch's longest context wastes up to half of the gather and attention
# work; a new group starts when a context is this much shorter than its group's longest.
GROUP_SHRINK = 0.7


@dataclass
class DecodeGroup:
    """Decodes ``start:end`` of similar context length, padded to the longest of them."""

    start: int
    end: int
    block_tables: torch.Tensor  # [n, max_blocks] int64, padded with block 0 (masked out)
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool, True = attend


@dataclass
class TorchMetadata(StepMetadata):
    num_decodes: int
    decode_groups: list[DecodeGroup]
    query_starts: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[torch.Tensor]  # per sequence, int64


class Workspace:
    """Scratch memory reused by every layer and step: gathering into fresh large allocations page-faults
    (measured 4x slower than into reused memory on CPU)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def tensors(self, shape: tuple[int, ...], count: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """``count`` tensors of ``shape``, valid until the next call."""
        numel = math.prod(shape)
        buf = self._buf
        if buf is None or buf.numel() < numel * count or buf.dtype != dtype or buf.device != device:
            buf = self._buf = torch.empty(int(numel * count * 1.25) + 1, dtype=dtype, device=device)
        return [buf[i * numel:(i + 1) * numel].view(shape) for i in range(count)]


class TorchAttention(AttentionBackend[TorchMetadata]):
    name = "torch"

    def __init__(self, block_size: int, num_blocks: int, device: torch.device) -> None:
        super().__init__(block_size, num_blocks, device)
        self.workspace = Workspace()

    def build(self, batch: Batch) -> TorchMetadata:
        starts, slots, logits_indices = self.common(batch)
        nd = batch.num_decodes
        tables, ctx = batch.block_tables[:nd], batch.context_lens[:nd]
        groups = [DecodeGroup(a, b, self.int64(pad_tables(tables[a:b])),
                              self._mask(ctx[a:b], len(tables[a]) * self.block_size))
                  for a, b in similar_runs([len(t) for t in tables])]
        return TorchMetadata(slots, logits_indices, nd, groups, starts, list(batch.query_lens),
                             list(batch.context_lens), [self.int64(t) for t in batch.block_tables])

    def _mask(self, context_lens: list[int], width: int) -> torch.Tensor:
        span = torch.arange(width, device=self.device)
        return (span[None, :] < self.int64(context_lens)[:, None])[:, None, None, :]

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMetadata, scale):
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        for i in range(nd, len(meta.query_lens)):
            rows = slice(meta.query_starts[i], meta.query_starts[i] + meta.query_lens[i])
            out[rows] = prefill_chunk(q[rows], k[rows], v[rows], k_cache, v_cache, meta.block_tables[i],
                                      meta.context_lens[i], scale)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TorchMetadata,
                scale: float) -> torch.Tensor:
        b, hq, d = q.shape
        hkv = k_cache.shape[0]
        grouped = q.view(b, hkv, hq // hkv, d)  # query heads of one KV head, side by side
        out = torch.empty_like(grouped)
        for g in meta.decode_groups:
            shape = (g.end - g.start, hkv, g.block_tables.shape[1] * k_cache.shape[2], d)
            keys, values = self.workspace.tensors(shape, 2, k_cache.dtype, k_cache.device)
            gather(k_cache, g.block_tables, keys)  # [n, Hkv, L, D]
            gather(v_cache, g.block_tables, values)
            keys, values = keys.to(q.dtype), values.to(q.dtype)  # fp8 caches: widened (exact)
            scores = torch.matmul(grouped[g.start:g.end], keys.transpose(-1, -2)) * scale  # [n, Hkv, G, L]
            scores = scores.masked_fill_(~g.mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            torch.matmul(probs, values, out=out[g.start:g.end])
        return out.view(b, hq, d)


def similar_runs(lengths: list[int]) -> list[tuple[int, int]]:
    """Split a non-increasing list into runs whose members are at least GROUP_SHRINK of the run's first."""
    runs, start = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] < GROUP_SHRINK * lengths[start]:
            runs.append((start, i))
            start = i
    return runs


def gather_rows(block_tables: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Row ids into a cache viewed as [Hkv * num_blocks, block_size * D], ordered (sequence, head, block)."""
    heads = torch.arange(num_kv_heads, device=block_tables.device).view(1, num_kv_heads, 1) * num_blocks
    return (heads + block_tables.view(block_tables.shape[0], 1, -1)).flatten()


def gather(cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Hkv, blocks * block_size, D] for block tables [B, blocks] (or one table [blocks])."""
    h, nb, bs, d = cache.shape
    tables = block_tables.view(-1, block_tables.shape[-1])
    rows = gather_rows(tables, h, nb)
    flat = cache.view(h * nb, bs * d)
    if out is None:
        return flat.index_select(0, rows).view(tables.shape[0], h, -1, d)
    torch.index_select(flat, 0, rows, out=out.view(rows.shape[0], bs * d))
    return out


def prefill_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """Causal attention output [Q, Hq, D] of one prefill chunk: queries ``q`` [Q, Hq, D] and their keys and
    values ``k``/``v`` [Q, Hkv, D] are the last Q of the sequence's ``context_len`` positions, all of which
    are in the caches at ``block_table``. The keys and values attended are the caches' (an fp8 cache's are
    rounded), as in a later step that finds this chunk a cached prefix."""
    if context_len == q.shape[0] and k_cache.dtype == k.dtype:  # no cached prefix: the fresh keys are all there is
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
    else:
        keys = gather(k_cache, block_table)[0, :, :context_len].to(q.dtype)
        values = gather(v_cache, block_table)[0, :, :context_len].to(q.dtype)
    return prefill_attention(q.transpose(0, 1), keys, values, scale).transpose(0, 1)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` [Hq, Q, D] over ``k``/``v`` [Hkv, C, D] where the queries are the last Q."""
    qlen, ctx = q.shape[1], k.shape[1]
    mask = None
    if ctx != qlen:
        # SDPA's is_causal aligns top-left; with a cached prefix the queries sit at the bottom-right.
        mask = torch.ones(qlen, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - qlen)
    # 4-D inputs: with 3-D ones SDPA falls back to its math path on CPU (2-3x slower than flash).
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=True)[0]
