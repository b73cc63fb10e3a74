"""The model's linear layers: ``nn.Linear`` whose multiplication is one kernel object (linear_kernels.py), chosen
once when the weights are laid out (``Linear.pack``, ``Linear.use_layout_only``; ``LlamaModel.pack_linear_weights``
decides which layout each layer gets), and weight-only int8 (``Linear.to_int8``, ``Int8Rows``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from backends.native.layer_ops import LayerOps
from backends.native.linear_kernels import (
    INT8,
    PLAIN,
    LinearKernel,
    OneDnnGateUpKernel,
    OneDnnKernel,
    StripKernel,
    TileKernel,
    strip_layout,
    tile_layout,
)

# A second copy of the weight for small steps: AMX/AVX512-BF16 tiles (bf16 activations) or AVX-512 strips (fp32).
SmallStepCopy = Literal["tiles", "strips"]


@dataclass
class Int8Rows:
    """A matrix as int8 ``values`` [rows, cols] and one fp32 ``scales`` entry per row: row i is
    ``values[i] * scales[i]`` (symmetric, absmax / 127)."""

    values: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Rows:
        """The rows of a float matrix, each rounded to the nearest of 255 levels of its own scale."""
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        return cls(torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8), scales)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix these rows stand for."""
        return self.values.float() * self.scales[:, None]


class Linear(nn.Linear):
    """``nn.Linear`` whose ``forward`` is its ``kernel``'s matmul: torch's until ``pack()`` (oneDNN's layout for float
    weights, optionally a small-step copy) or ``use_layout_only()`` (tiles alone) chooses another; ``to_int8()``
    makes the weight int8."""

    kernel: LinearKernel = PLAIN
    weight: nn.Parameter

    def pack(self, small_steps: SmallStepCopy | None = None, keep_weight: bool = False) -> None:
        """Choose this layer's kernel once its weight is loaded: float weights packed for oneDNN (``can_pack`` must
        hold), int8 ones kept for the int8 kernel; with ``small_steps``, a copy in that layout serves the small steps
        (``can_tile`` / ``can_strip`` must hold). The float weight is dropped unless ``keep_weight``."""
        small = None if small_steps is None else (tile_layout if small_steps == "tiles" else strip_layout)(self.weight)
        kernel = INT8 if self.is_int8 else self._packed(keep_weight)
        if small is not None:
            kernel = TileKernel(small, kernel) if small_steps == "tiles" else StripKernel(small, kernel)
        self.kernel = kernel

    def _packed(self, keep_weight: bool) -> LinearKernel:
        """The oneDNN kernel on a packed copy of the float weight, which that copy replaces unless ``keep_weight``."""
        kernel = OneDnnKernel(torch.ops.mkldnn._reorder_linear_weight(self.weight.detach()))
        self._drop_weight(keep_weight)
        return kernel

    def _drop_weight(self, keep_weight: bool) -> None:
        if not keep_weight:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def use_layout_only(self, keep_weight: bool = False) -> None:
        """Serve every step from the weight's tile layout (``layout_serves_all_rows`` must hold): no packed copy;
        the weight (float, or int8 beside its ``scales``) is dropped unless ``keep_weight``."""
        self.kernel = TileKernel(tile_layout(self.weight))
        self._drop_weight(keep_weight)

    def to_int8(self) -> None:
        """Hold the weight as int8 with a scale per output channel (``scales``, in the weight's float dtype);
        ``load_weights`` fills both. Before loading: the float weight is only replaced, not converted."""
        out_features = self.weight.shape[0]
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=torch.int8, device=self.weight.device),
                                   requires_grad=False)
        self.scales = nn.Parameter(torch.empty(out_features, dtype=torch.float32, device=self.weight.device),
                                   requires_grad=False)
        self.kernel = INT8

    @property
    def is_int8(self) -> bool:
        return self.weight.dtype == torch.int8

    @property
    def layout_only(self) -> bool:
        """Whether the tile layout is the weight's only copy and serves every step."""
        return isinstance(self.kernel, TileKernel) and self.kernel.larger is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.matmul(self, x)

    def with_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output and the residual stream it joins, as the next ``RMSNorm`` takes them: ``(x @ W.T,
        residual)``, for the norm to add; or, where the kernel adds in its rounding pass (tiles alone, bf16
        activations, more than ``TILE_ROWS`` rows, no bias), the sum made in place in ``residual``, as torch rounds
        it: ``(residual, None)``: the norms that follow no longer add."""
        if self.kernel.add_into(self, x, residual):
            return residual, None
        return self(x), residual


class GateUpLinear(Linear):
    """SwiGLU's gate and up projections side by side (``weight`` [2I, k], the gate's rows first), whose one use is
    ``silu_and_mul``: silu(gate) * up [..., I], from the kernel's rounding pass or epilogue where it has one
    (tiles alone, past ``TILE_ROWS`` rows; oneDNN in bf16, the halves packed apart), else from ``ops``."""

    def _packed(self, keep_weight: bool) -> LinearKernel:
        if self.weight.dtype != torch.bfloat16 or keep_weight:  # one matmul on the whole weight, then the op
            return super()._packed(keep_weight)
        gate, up = self.weight.detach().chunk(2)
        kernel = OneDnnGateUpKernel(torch.ops.mkldnn._reorder_linear_weight(gate.contiguous()),
                                    torch.ops.mkldnn._reorder_linear_weight(up.contiguous()))
        self._drop_weight(keep_weight)
        return kernel

    def silu_and_mul(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T); ``ops`` (layer_ops.py) multiplies where no epilogue does."""
        return self.kernel.silu_and_mul(self, x, ops)
