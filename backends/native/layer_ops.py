"""The elementwise parts of a decoder layer, behind one contract with two implementations.

``TorchLayerOps`` is the reference (plain torch, any device, HF Llama's rounding in bf16); ``CpuLayerOps``
runs the same three ops as the C kernels of csrc/layer_ops.c, one pass over memory each and in place
where torch allocates. In a bf16 prefill step on CPU the torch versions (fp32 copies, 3-6 passes per op)
cost as much as attention. ``attention.choose_kernels`` picks one per model.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from backends.native.cpu_kernels import DTYPE_FLAGS, kv_format, library, load
from backends.native.rotary import apply_rotary


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values [T, Hkv, D] into the caches [Hkv, num_blocks, block_size, D], rounded to
    an fp8 cache's type (to nearest, saturating: see ``to_cache_dtype``)."""
    h, _, _, d = k_cache.shape
    for x, cache in ((k, k_cache), (v, v_cache)):
        x = to_cache_dtype(x.transpose(0, 1), cache.dtype)
        if x.dtype.itemsize == 1:  # torch has no index_copy_ for fp8 on CPU: copy the bytes
            x, cache = x.view(torch.uint8), cache.view(torch.uint8)
        cache.view(h, -1, d).index_copy_(1, slot_mapping, x)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a KV cache of ``dtype`` stores it: fp8 saturates at its largest finite value, as vLLM's
    conversions do (torch's own gives inf for e5m2), and rounds to nearest even."""
    if dtype == x.dtype:
        return x
    if dtype.itemsize == 1:
        largest = torch.finfo(dtype).max
        x = x.float().clamp(-largest, largest)
    return x.to(dtype)


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D] as views of the fused projection ``qkv`` [T, (Hq + 2 Hkv) * D]."""
    heads = qkv.view(qkv.shape[0], -1, head_dim)
    return heads[:, :num_heads], heads[:, num_heads:num_heads + num_kv_heads], heads[:, num_heads + num_kv_heads:]


class LayerOps(Protocol):
    """The contract: a class of static methods (``TorchLayerOps``, ``CpuLayerOps``, triton_layer_ops.py's
    ``TritonLayerOps``), used as the class itself."""

    name: str

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor: ...

    @staticmethod
    def rotary_store_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class TorchLayerOps:
    """Reference implementations in plain torch."""

    name = "torch"

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual) * weight, x + residual); without a residual, (rms_norm(x) * weight, x).

        The norm is computed in fp32 and cast back before the weight, as HF's LlamaRMSNorm does."""
        if residual is not None:
            x = x + residual
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype), x

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation: silu(gate) * up for ``x`` [T, 2I] = gate and up side by side."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotary_store_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split ``qkv`` [T, (Hq + 2 Hkv) * D] into q [T, Hq, D], k and v [T, Hkv, D], rotate q and k by
        ``cos``/``sin`` [T, 1, D/2] (fp32), and store k and v at ``slot_mapping`` [T] in the head-major caches."""
        d = k_cache.shape[-1]
        # Query and key heads are rotated together: one pass over the adjacent columns.
        qk = apply_rotary(qkv[:, :(num_heads + num_kv_heads) * d].view(-1, num_heads + num_kv_heads, d), cos, sin)
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        v = qkv[:, (num_heads + num_kv_heads) * d:].view(-1, num_kv_heads, d)
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q, k, v


class CpuLayerOps:
    """The same ops as C kernels for CPU tensors stored as fp32 or bf16 (``available`` says whether they
    run here). Inputs must be contiguous rows; results are written in place where the contract allows."""

    name = "C"

    @staticmethod
    def available(dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in DTYPE_FLAGS and load() is not None

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``TorchLayerOps.add_rms_norm``; with a residual, the sum overwrites ``residual`` and the
        normalised rows overwrite ``x``."""
        x = x.contiguous()
        out = x if residual is not None else torch.empty_like(x)
        library().add_rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
                               out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, DTYPE_FLAGS[x.dtype])
        return out, x if residual is None else residual

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """As ``TorchLayerOps.silu_and_mul``."""
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
        library().silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], out.shape[-1],
                               DTYPE_FLAGS[x.dtype])
        return out

    @staticmethod
    def rotary_store_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``TorchLayerOps.rotary_store_kv``; q, k and v are views of ``qkv``, rotated in place."""
        qkv, t, d = qkv.contiguous(), qkv.shape[0], k_cache.shape[-1]
        cos, sin = cos.contiguous(), sin.contiguous()
        library().rotary_store_kv(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                                  v_cache.data_ptr(), slot_mapping.data_ptr(), t, num_heads, num_kv_heads, d,
                                  k_cache.shape[1] * k_cache.shape[2], DTYPE_FLAGS[qkv.dtype], kv_format(k_cache))
        return split_heads(qkv, num_heads, num_kv_heads, d)
