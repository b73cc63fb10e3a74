"""Rotary position embeddings in HF's rotate-half layout, with llama3 and linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair rotation frequencies, computed in fp32 (``1 / theta^(2i/d)``, then scaled)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_scaled(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    original = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """Cos/sin tables for every position up to ``max_positions``, applied by position index.

    The tables are plain fp32 tensors rather than module buffers, so casting the model to bf16 leaves
    them alone: bf16 angles change greedy outputs.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 device: torch.device | str = "cpu") -> None:
        if torch.device(device).type == "meta":
            # A model's skeleton, built before its memory: shapes only. Computing on meta goes through torch's
            # Python references, whose first use imports its compiler (docs/performance.md, "Start-up").
            self.cos = self.sin = torch.empty(max_positions, head_dim // 2, device="meta")
            return
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq).to(device)
        self.cos, self.sin = angles.cos(), angles.sin()

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, D/2] for ``positions`` [T]: looked up once per step, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] (HF's rotate-half layout), computed in fp32; returns a new contiguous tensor.

    Each half is written in place with mul + addcmul (no ``cat``): faster than the textbook form (docs/performance.md).
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.empty(xf.shape, dtype=torch.float32, device=x.device)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out.to(x.dtype)
