"""Paged attention backends, one per path, and the choice of kernels for a model.

- ``TorchAttention`` (torch_attention.py): plain torch; the reference, and the fallback everywhere.
- ``CpuAttention`` (cpu_attention.py): C kernels that read the cache in place, on CPU.
- ``TritonAttention`` (triton_attention.py): one Triton kernel for prefill and decode, on CUDA; the path
  CUDA graphs capture.

The elementwise layer ops come with the path: torch, C (layer_ops.py) or Triton (triton_layer_ops.py).

Each builds its own metadata from the scheduler's flat ``Batch`` and runs every layer's attention. A new
kernel path is one more backend here and one more branch in ``choose_kernels``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backends.native.attention.base import AttentionBackend, StepMetadata
from backends.native.attention.torch_attention import TorchAttention
from backends.native.config import ModelConfig
from backends.native.layer_ops import CpuLayerOps, LayerOps, TorchLayerOps

__all__ = ["KERNEL_CHOICES", "AttentionBackend", "Kernels", "StepMetadata", "choose_kernels"]

KERNEL_CHOICES = ("auto", "torch")


@dataclass(frozen=True)
class Kernels:
    """What one model runs on besides matmuls: an attention backend and the elementwise layer ops."""

    attention: AttentionBackend[Any]
    layer_ops: LayerOps  # TorchLayerOps, CpuLayerOps or TritonLayerOps, the class itself

    def describe(self) -> str:
        """For the start-up log line."""
        return f"{self.attention.name} attention, {self.layer_ops.name} layer ops"


def choose_kernels(kernels: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                   block_size: int, num_blocks: int) -> Kernels:
    """``auto``: on CUDA, the Triton kernels for attention and layer ops; on CPU, the C kernels, where they
    build here (in bf16 with AMX, prefill on the tiles); either where they take the layout (head size,
    heads per KV head). ``torch``: pure torch."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernels {kernels!r}; choose one of {KERNEL_CHOICES}")
    torch_attention = TorchAttention(block_size, num_blocks, device)
    if kernels == "torch":
        return Kernels(torch_attention, TorchLayerOps)
    if device.type == "cuda":  # imported here: CPU installs need no Triton
        from backends.native.attention import triton_attention
        from backends.native.triton_layer_ops import TritonLayerOps

        layer_ops: LayerOps = TritonLayerOps if TritonLayerOps.available(dtype, config.head_dim) else TorchLayerOps
        if triton_attention.supports(config.head_dim):
            return Kernels(triton_attention.TritonAttention(block_size, num_blocks, device), layer_ops)
        return Kernels(torch_attention, layer_ops)
    from backends.native.attention import cpu_attention

    layer_ops = CpuLayerOps if CpuLayerOps.available(dtype, device) else TorchLayerOps
    if cpu_attention.supports(dtype, config.num_heads, config.num_kv_heads, config.head_dim, block_size):
        return Kernels(cpu_attention.CpuAttention(block_size, num_blocks, device), layer_ops)
    return Kernels(torch_attention, layer_ops)
