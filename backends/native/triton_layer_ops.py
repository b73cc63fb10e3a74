"""The layer ops of layer_ops.py as Triton kernels for CUDA: one launch per op instead of four to ten.

At batch 1 a decoder layer's elementwise work is a few kilobytes, but in torch it is some thirty
kernels of a few microseconds each, which made up a third of the 12.3B model's decode step on an H100
(and most of a small model's). Each op here is one kernel: residual add + RMSNorm, SwiGLU's
silu-and-mul, and rotary embedding of q and k with the key/value store into the paged cache. Same
contract and rounding points as ``TorchLayerOps`` (HF Llama's in bf16), in place like ``CpuLayerOps``.
Tested on CPU under Triton's interpreter and on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.native.layer_ops import split_heads


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, n, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * n
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = (xf / tl.sqrt_rn(tl.sum(xf * xf, 0) / n + eps)).to(x.dtype)  # cast back before the weight, as HF
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row + cols, (normed.to(tl.float32) * weight.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded before the product, as torch's two ops do
    tl.store(out_ptr + row * n + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


@triton.jit
def _rotary_store_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_t, cache_stride_h,
                            NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    half = tl.arange(0, HEAD_DIM // 2)
    base = qkv_ptr + token * stride_t + head * HEAD_DIM
    first = tl.load(base + half)
    second = tl.load(base + HEAD_DIM // 2 + half)
    slot = tl.load(slots_ptr + token).to(tl.int64)  # 64-bit cache offsets, as in the paged attention kernel
    if head < NUM_HEADS + NUM_KV_HEADS:  # rotate q or k in place
        cos = tl.load(cos_ptr + token * (HEAD_DIM // 2) + half)
        sin = tl.load(sin_ptr + token * (HEAD_DIM // 2) + half)
        a, b = first.to(tl.float32), second.to(tl.float32)
        first = (a * cos - b * sin).to(first.dtype)
        second = (b * cos + a * sin).to(second.dtype)
        tl.store(base + half, first)
        tl.store(base + HEAD_DIM // 2 + half, second)
        if head >= NUM_HEADS:
            cache = k_cache_ptr + (head - NUM_HEADS).to(tl.int64) * cache_stride_h + slot * HEAD_DIM
            tl.store(cache + half, first)
            tl.store(cache + HEAD_DIM // 2 + half, second)
    else:
        cache = v_cache_ptr + (head - NUM_HEADS - NUM_KV_HEADS).to(tl.int64) * cache_stride_h + slot * HEAD_DIM
        tl.store(cache + half, first)
        tl.store(cache + HEAD_DIM // 2 + half, second)


class TritonLayerOps:
    """The layer ops on CUDA tensors of any float type, for head sizes that are powers of two."""

    name = "Triton"

    @staticmethod
    def available(dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in (torch.float32, torch.bfloat16, torch.float16) and head_dim >= 2 and not head_dim & (head_dim - 1)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``TorchLayerOps.add_rms_norm``; with a residual, the sum overwrites ``residual`` and the
        normalised rows overwrite ``x``."""
        x = x.contiguous()
        n = x.shape[-1]
        out = x if residual is not None else torch.empty_like(x)
        _add_rms_norm_kernel[(x.numel() // n,)](x, x if residual is None else residual, weight, out,
                                                x if residual is None else residual, n, eps,
                                                HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
        return out, x if residual is None else residual

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """As ``TorchLayerOps.silu_and_mul``."""
        x = x.contiguous()
        n = x.shape[-1] // 2
        out = x.new_empty(*x.shape[:-1], n)
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(x.numel() // x.shape[-1], triton.cdiv(n, block))](x, out, n, BLOCK=block)
        return out

    @staticmethod
    def rotary_store_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``TorchLayerOps.rotary_store_kv``; q, k and v are views of ``qkv``, rotated in place."""
        qkv, t, d = qkv.contiguous(), qkv.shape[0], k_cache.shape[-1]
        _rotary_store_kv_kernel[(t, num_heads + 2 * num_kv_heads)](
            qkv, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slot_mapping, qkv.stride(0),
            k_cache.shape[1] * k_cache.shape[2] * d, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=d)
        return split_heads(qkv, num_heads, num_kv_heads, d)
