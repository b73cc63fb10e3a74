"""Paged attention for CPUs: the C kernels of csrc/paged_attention.c, csrc/decode_attention_amx.c and
csrc/prefill_attention_amx.c (built by cpu_kernels.py).

Decode: the pure-torch path gathers every sequence's K/V blocks into a contiguous copy before two
matmuls; on CPU that copy dominated decode time. The kernel reads the paged cache in place instead
(several times faster per layer); in bf16 on a CPU with AMX tiles, paged_decode_attention hands decodes to the tile
kernel of csrc/decode_attention_amx.c (bf16 and fp8 caches). Prefill: a tiled causal kernel over the same cache, for chunks with or
without a cached prefix, a tile of query rows (64 with AVX-512) as vector lanes against keys and values read
in place: no gather of cached prefixes, and faster than torch's causal SDPA kernel on contiguous keys.
In bf16 on a CPU with AMX tiles, prefill chunks go to a flash-attention kernel on the tiles instead
(``amx_prefill``; csrc/prefill_attention_amx.c), faster than torch's flash kernel (oneDNN brgemm on the tiles,
which the engine used before) and than the vector kernel.
Without a C compiler the engine keeps the pure-torch path (torch_attention.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from backends.native.attention.base import AttentionBackend, StepMetadata, pad_tables
from backends.native.batch import Batch
from backends.native.cpu_kernels import DTYPE_FLAGS, kv_format, library, load


@dataclass
class CpuMetadata(StepMetadata):
    num_decodes: int
    # decodes: block tables padded to one width, and context lengths
    decode_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    # prefill chunks: the same, with each chunk's first row (counted from the first prefill token) and length
    prefill_tables: torch.Tensor
    prefill_query_starts: torch.Tensor
    prefill_query_lens: torch.Tensor
    prefill_context_lens: torch.Tensor


class CpuAttention(AttentionBackend[CpuMetadata]):
    """Decodes and prefill chunks on the C kernels, reading the cache in place; bf16 prefill chunks on the AMX
    tiles where the CPU has them, unless ``amx_prefill`` is off (see the module docstring)."""

    def __init__(self, block_size: int, num_blocks: int, device: torch.device, amx_prefill: bool = True) -> None:
        super().__init__(block_size, num_blocks, device)
        self.amx_prefill = amx_prefill
        self.name = "C paged"

    def build(self, batch: Batch) -> CpuMetadata:
        starts, slots, logits_indices = self.common(batch)
        nd = batch.num_decodes
        tables = pad_tables(batch.block_tables[:nd]), pad_tables(batch.block_tables[nd:])
        return CpuMetadata(
            slots, logits_indices, nd,
            self.int64(tables[0]), self.int64(batch.context_lens[:nd]),
            self.int64(tables[1]), self.int64([s - nd for s in starts[nd:]]),
            self.int64(batch.query_lens[nd:]), self.int64(batch.context_lens[nd:]))

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuMetadata, scale):
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_tables, meta.decode_context_lens, scale,
                                   out=out[:nd])
        if len(meta.prefill_query_lens):
            paged_prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_tables, meta.prefill_query_starts,
                                    meta.prefill_query_lens, meta.prefill_context_lens, scale, out=out[nd:],
                                    amx=self.amx_prefill)
        return out


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether attention of this layout can run on the kernels: built here, a storage type and shape they take."""
    lib = load() if dtype in DTYPE_FLAGS else None
    return lib is not None and bool(lib.paged_attention_supported(num_heads, num_kv_heads, head_dim, block_size))


def _rows(q: torch.Tensor) -> torch.Tensor:
    """``q`` [tokens, Hq, D] as the kernels read it: heads contiguous, any stride between tokens."""
    return q if q.stride(2) == 1 and q.stride(1) == q.shape[2] else q.contiguous()


def _checked(rc: int, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    if rc != 0:
        raise ValueError(f"CPU paged-attention kernel: unsupported layout (heads {q.shape[1]}/{k_cache.shape[0]}, "
                         f"head_dim {q.shape[2]}, block_size {k_cache.shape[2]}); check supports() first")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output [B, Hq, D] for one new query token per sequence (same contract as the Triton kernel).

    ``q`` [B, Hq, D]; caches [Hkv, num_blocks, block_size, D] (contiguous; as ``q`` or fp8); ``block_tables`` [B, max_blocks]
    and ``context_lens`` [B], int64. Written into ``out`` (contiguous) when given.
    """
    return _run(library().paged_decode_attention, q, k_cache, v_cache, block_tables, [context_lens], scale, out)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor, query_lens: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                            amx: bool = True) -> torch.Tensor:
    """Causal attention output [T, Hq, D] for prefill chunks whose keys are in the paged cache already.

    Sequence ``i`` owns rows ``query_starts[i]:query_starts[i] + query_lens[i]`` of ``q`` [T, Hq, D]; they
    are the last of its ``context_lens[i]`` positions (a cached prefix precedes them). ``block_tables``
    [n, max_blocks]; the per-sequence tensors [n], int64. Written into ``out`` (contiguous) when given.
    With ``amx``, bf16 runs on the AMX tiles where ``amx_prefill_runs``.
    """
    hkv, _, block_size, d = k_cache.shape
    tiles = amx and amx_prefill_runs(q.dtype, scale, q.shape[1], hkv, d, block_size)
    kernel = library().paged_prefill_attention_amx if tiles else library().paged_prefill_attention
    return _run(kernel, q, k_cache, v_cache, block_tables, [query_starts, query_lens, context_lens], scale, out)


def amx_prefill_runs(dtype: torch.dtype, scale: float, num_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int) -> bool:
    """Whether prefill chunks of this layout run on csrc/prefill_attention_amx.c here: bf16 on AMX tiles, a
    layout it takes, and ``scale`` > 0 (the tile kernel keeps its running maxima on unscaled scores)."""
    return dtype == torch.bfloat16 and scale > 0 and _amx_prefill_supported(num_heads, num_kv_heads, head_dim,
                                                                            block_size)


@functools.cache
def _amx_prefill_supported(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether csrc/prefill_attention_amx.c runs this layout here: asked once per layout, not per layer."""
    return bool(library().prefill_attention_amx_supported(num_heads, num_kv_heads, head_dim, block_size))


def _run(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
         per_sequence: list[torch.Tensor], scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Call a paged-attention kernel (csrc/paged_attention.c, csrc/prefill_attention_amx.c): all take q, the
    caches and block tables, then their per-sequence int64 arrays, then the output, the sequence count, the
    layout and the storage types."""
    q, tables = _rows(q), block_tables.contiguous()
    hkv, num_blocks, block_size, d = k_cache.shape
    out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
    _checked(kernel(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                    tables.stride(0), *(t.data_ptr() for t in per_sequence), out.data_ptr(), len(per_sequence[0]),
                    q.shape[1], hkv, num_blocks, block_size, d, scale, DTYPE_FLAGS[q.dtype], kv_format(k_cache)),
             q, k_cache)
    return out
