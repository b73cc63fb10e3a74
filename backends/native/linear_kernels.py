"""How a linear layer's weight is laid out and multiplied: one kernel object per kind (plain torch, oneDNN-packed,
int8, AMX/AVX512-BF16 tiles, AVX-512 strips), chosen once when the layer's weights are laid out (linear.py).

``F.linear`` on CPU hands the weight to MKL, which packs it again on every call. Packing once with
oneDNN, as vLLM's CPU backend does (``onednn_mm`` on prepacked weights), saves that on every call. The
packed copy replaces the weight, so memory does not double, except for a
weight tied to the embedding table, which the embedding lookup still reads.

Decoding a few sequences reads every weight once per step, so its speed is the memory's: int8 weights
(``quantization: int8``) read a quarter of fp32's bytes. Activations stay in the model's dtype. Up to
``INT8_KERNEL_ROWS`` rows go through the C kernel csrc/int8_linear.c (torch's ``_weight_int8pack_mm``, which
gpt-fast's int8 mode uses, has no AVX2 path: benchmarks/int8_matmul.py);
more rows (a prefill) are compute-bound, and multiply a dequantised copy of the weight made for the call, except
for bf16 activations on AMX tiles, where the int8 weight is laid out as tiles too and the tile kernel's blocked
path widens them chunk by chunk. A GGUF Q8_0 tensor becomes these rows without a float copy of the matrix
(weights.py).

On CPUs with AMX tiles, bf16 weights are laid out as AMX tiles (``tile_layout``, csrc/tile_linear.c). Steps of
up to ``TILE_ROWS`` rows stream them in order, near the copy bandwidth, where oneDNN's matmul on its packed
weight is not; larger steps multiply them in cache-sized blocks, faster than oneDNN's matmul on SmolLM2's
shapes, with SwiGLU's silu(gate) * up (``tile_silu_mul``) or the residual add (``tile_add``) in the rounding
pass. So where a weight's outputs are a multiple of 32 the tile layout is its only copy (``layout_serves_all_rows``: a
``TileKernel`` with no larger kernel), bf16 or int8 (widened to bf16 tile by tile, its columns scaled in the rounding pass);
otherwise it is a second copy for small steps. CPUs with AVX512-BF16 but no tiles (AMD Zen 4) read the same
layout on vectors for steps of up to ``TILE_ROWS`` rows (``tile_steps``), where oneDNN's matmul is slower
(benchmarks/small_step_matmul.py); larger steps there stay on oneDNN's packed copy.
fp32 weights get the like on CPUs with AVX-512: steps of up to ``STRIP_ROWS`` rows read a copy laid out as
strips of 32 output columns (``strip_layout``, csrc/strip_linear.c). A second copy doubles the linear weights'
memory, so the model keeps it only where it fits easily (``LlamaModel.pack_linear_weights``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backends.native import cpu_kernels
from backends.native.layer_ops import LayerOps

# Above this many rows the int8 kernel, which widens each weight once per four rows, loses to dequantising
# the weight and calling a blocked GEMM (measured on SmolLM2's shapes, AVX2).
INT8_KERNEL_ROWS = 32
# Up to this many rows a bf16 matmul with a tile copy streams it (csrc/tile_linear.c, whose STREAM_ROWS is the
# same); weights whose tile layout is their only copy (``layout_only``) take its blocked path beyond, the others
# oneDNN's matmul: up to here streaming the tiles is faster (docs/performance.md, "Measurements behind the
# code").
TILE_ROWS = 64
# Up to this many rows an fp32 matmul with a strip copy runs on csrc/strip_linear.c, faster than oneDNN's
# (docs/performance.md, "Measurements behind the code").
STRIP_ROWS = 128


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch build can pack weights of ``dtype`` on ``device`` for oneDNN matmuls."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()  # native bf16 instructions, not emulation
    return dtype == torch.float32


def layout_serves_all_rows(weight: torch.Tensor, activations: torch.dtype) -> bool:
    """Whether the tile layout of ``weight`` serves steps of every size for ``activations`` of this dtype, faster
    than oneDNN's matmul, so it can be the weight's only copy (csrc/tile_linear.c's blocked path, for more than
    ``TILE_ROWS`` rows, takes bf16 activations and bf16 or int8 weights whose outputs are a multiple of 32; int8
    ones, dequantised for oneDNN's bf16 matmul instead, made prefills slower than bf16's). fp32 strips do not:
    past ``STRIP_ROWS`` rows they only drew level with oneDNN over a step's weights not in cache
    (docs/performance.md)."""
    return (activations == torch.bfloat16 and weight.shape[0] % 32 == 0 and can_tile(weight)
            and tile_steps() == TILE_STEPS_ANY)


# What csrc/tile_linear.c multiplies on this CPU (its tile_linear_supported): steps of any size on AMX tiles,
# steps of up to TILE_ROWS rows on AVX512-BF16 vectors (AMD Zen 4), nothing.
TILE_STEPS_NONE, TILE_STEPS_SMALL, TILE_STEPS_ANY = 0, 1, 2


def tile_steps() -> int:
    """Which steps the tile layout serves on this CPU: ``TILE_STEPS_ANY``, ``TILE_STEPS_SMALL`` or ``TILE_STEPS_NONE``."""
    lib = cpu_kernels.load()
    return TILE_STEPS_NONE if lib is None else lib.tile_linear_supported()


def can_tile(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can have a tile copy: bf16 (or int8, for bf16 activations) on a CPU with AMX tiles or
    AVX512-BF16, its shape a multiple of 16 x 32."""
    if weight.dtype not in (torch.bfloat16, torch.int8) or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 and tile_steps() != TILE_STEPS_NONE


def tile_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [n, k] as tile_linear.c reads it: for each 16 output rows, for each 32 columns, one AMX B tile
    (16 column pairs x 16 outputs x 2, 1 KB); the tiles of 16 outputs lie one after the other."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def _check_activations(x: torch.Tensor, dtype: torch.dtype, kernel: str) -> None:
    """The C kernels read ``x`` as ``dtype``: anything else is refused here, not read as garbage there."""
    if x.dtype != dtype:
        raise ValueError(f"{kernel} multiplies {dtype} activations, not {x.dtype}")


def _weight_args(tiles: torch.Tensor, scales: torch.Tensor | None) -> tuple[int, int | None]:
    """The C kernels' weight arguments around ``out``: (tiles, scales or NULL)."""
    return tiles.data_ptr(), None if scales is None else scales.data_ptr()


def _scale_flags(tiles: torch.Tensor, scales: torch.Tensor | None) -> tuple[bool, bool]:
    """The C kernels' last two arguments: (int8 tiles, scales stored as bf16)."""
    return tiles.dtype == torch.int8, scales is not None and scales.dtype == torch.bfloat16


def tile_silu_mul(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for bf16 x [rows, k], from the ``tile_layout`` of [gate; up] (bf16, or int8
    with ``scales``), rounded as HF's bf16 Llama rounds (gate and up, the silu, the product)."""
    _check_activations(x, torch.bfloat16, "tile_linear_silu_mul")
    k, half = x.shape[-1], tiles.shape[0] * 16 // 2  # tiles of 16 outputs: the gate's, then the up's
    x = x.contiguous()
    out = x.new_empty(*x.shape[:-1], half)
    if cpu_kernels.library().tile_linear_silu_mul(x.data_ptr(), *_weight_args(tiles, scales), out.data_ptr(),
                                                  x.numel() // k, half, k, *_scale_flags(tiles, scales)):
        raise RuntimeError(f"tile_linear_silu_mul refused a [{2 * half}, {k}] weight")
    return out


def tile_add(x: torch.Tensor, tiles: torch.Tensor, residual: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """``residual += x @ weight.T`` in place, for bf16 x [rows, k] of more than ``TILE_ROWS`` rows and a contiguous
    residual [rows, n], from the weight's ``tile_layout`` (bf16, or int8 with ``scales``), rounded as torch adds a
    bf16 layer's output to the residual stream (the product rounded first, then the sum)."""
    _check_activations(x, torch.bfloat16, "tile_linear_add")
    k, n = x.shape[-1], tiles.shape[0] * 16
    x = x.contiguous()
    if cpu_kernels.library().tile_linear_add(x.data_ptr(), *_weight_args(tiles, scales), residual.data_ptr(),
                                             x.numel() // k, n, k, *_scale_flags(tiles, scales)):
        raise RuntimeError(f"tile_linear_add refused a [{n}, {k}] weight at {x.numel() // k} rows")


def tile_matmul(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` for bf16 x [..., k], from the weight's ``tile_layout`` (bf16, or int8 with ``scales``)."""
    _check_activations(x, torch.bfloat16, "tile_linear")
    k, n = x.shape[-1], tiles.shape[0] * 16
    x = x.contiguous()
    out = x.new_empty(*x.shape[:-1], n)
    if cpu_kernels.library().tile_linear(x.data_ptr(), *_weight_args(tiles, scales), out.data_ptr(), x.numel() // k,
                                         n, k, *_scale_flags(tiles, scales)):
        raise RuntimeError(f"tile_linear refused a [{n}, {k}] weight")
    return out


def can_strip(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can have a strip copy: fp32 on a CPU with AVX-512, its outputs a multiple of 32."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[0] % 32:
        return False
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.strip_linear_supported())


def strip_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [n, k] as strip_linear.c reads it: for each 32 output rows, their k columns one after the other
    (32 floats per column), the strips one after the other: [n / 32, k, 32]."""
    n, k = weight.shape
    return weight.detach().reshape(n // 32, 32, k).transpose(1, 2).contiguous()


def strip_matmul(x: torch.Tensor, strips: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for fp32 x [..., k], from the weight's ``strip_layout``."""
    _check_activations(x, torch.float32, "strip_linear")
    k, n = x.shape[-1], strips.shape[0] * 32
    x = x.contiguous()
    out = x.new_empty(*x.shape[:-1], n)
    if cpu_kernels.library().strip_linear(x.data_ptr(), strips.data_ptr(), out.data_ptr(), x.numel() // k, n, k):
        raise RuntimeError(f"strip_linear refused a [{n}, {k}] weight")
    return out


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none",
                  times: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's matmul on a packed weight (plus ``bias``), ``activation`` applied to its sums; with ``times`` (a
    second packed weight), that result multiplies x @ times.T in the second matmul's epilogue."""
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, activation, [], "")
    return y if times is None else torch.ops.mkldnn._linear_pointwise.binary(x, y, times, None, "mul")


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scales[:, None]).T`` for x [rows, k] (fp32 or bf16), int8 ``weight`` [n, k]."""
    lib = cpu_kernels.load() if x.device.type == "cpu" and x.dtype in cpu_kernels.DTYPE_FLAGS else None
    if lib is None or x.shape[0] > INT8_KERNEL_ROWS:
        return F.linear(x, weight.to(x.dtype)) * scales
    x = x.contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    lib.int8_linear(x.data_ptr(), weight.data_ptr(), scales.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0],
                    weight.shape[1], cpu_kernels.DTYPE_FLAGS[x.dtype])
    return out


class LinearKernel:
    """How one linear layer multiplies (``x @ W.T + bias``), chosen once when its weights are laid out
    (``Linear.pack``, ``Linear.use_layout_only``): ``Linear.forward`` calls ``matmul`` and nothing else decides.
    The kernel holds the layouts it made (``layouts``); the layer keeps its parameters (the weight where one is kept,
    int8 scales, the bias), which the kernel reads through the layer it is given."""

    name = "plain"  # F.linear on the layer's weight: torch's own matmul (MKL on CPU, cuBLAS on CUDA)
    compiles_per_shape = False  # whether each new row count costs a compilation (oneDNN's packed matmuls)

    def matmul(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` for x [..., in_features]."""
        return F.linear(x, layer.weight, layer.bias)

    def silu_and_mul(self, layer: nn.Linear, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) for a layer whose weight is [gate; up]; ``ops`` (layer_ops.py) multiplies
        where the kernel has no epilogue for it."""
        return ops.silu_and_mul(self.matmul(layer, x))

    def add_into(self, layer: nn.Linear, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Add ``x @ W.T`` into ``residual`` in place where this kernel's rounding pass can (False: it did not)."""
        return False

    def layouts(self) -> list[torch.Tensor]:
        """The tensors this kernel holds beside the layer's parameters (packed weights, tiles, strips)."""
        return []

    def small_step_copy(self) -> torch.Tensor | None:
        """The second copy of the weight that serves small steps only (tiles or strips), or None."""
        return None

    def describe(self) -> str:
        """For ``GET /info`` and the start-up log: the kernel, and which steps each part of it serves."""
        return self.name


PLAIN = LinearKernel()


class Int8Kernel(LinearKernel):
    """Weight-only int8 (the layer's ``weight`` and ``scales``): csrc/int8_linear.c up to ``INT8_KERNEL_ROWS``
    rows, a dequantised copy of the weight beyond."""

    name = "int8"

    def matmul(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        y = int8_matmul(x.reshape(-1, x.shape[-1]), layer.weight, layer.scales).reshape(*x.shape[:-1], -1)
        return y if layer.bias is None else y + layer.bias


INT8 = Int8Kernel()


class OneDnnKernel(LinearKernel):
    """oneDNN's matmul on the weight it packed once (the bias in its epilogue)."""

    name = "onednn"
    compiles_per_shape = True

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed

    def matmul(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed, layer.bias)

    def layouts(self) -> list[torch.Tensor]:
        return [self.packed]


class OneDnnGateUpKernel(LinearKernel):
    """SwiGLU's gate and up weights packed apart for oneDNN (bf16): the product comes out of the matmuls'
    epilogues (swish on the gate's sums, then the up's sums times that), with no [T, 2I] intermediate and no pass
    of its own. HF rounds the gate to bf16 before the silu; the epilogue takes the fp32 sums (within one bf16
    rounding)."""

    name = "onednn-swiglu"
    compiles_per_shape = True

    def __init__(self, gate: torch.Tensor, up: torch.Tensor) -> None:
        self.gate, self.up = gate, up

    def matmul(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:  # both halves, for callers other than the MLP
        return torch.cat([onednn_linear(x, self.gate), onednn_linear(x, self.up)], dim=-1)

    def silu_and_mul(self, layer: nn.Linear, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return onednn_linear(x, self.gate, activation="swish", times=self.up)

    def layouts(self) -> list[torch.Tensor]:
        return [self.gate, self.up]


def _scales(layer: nn.Linear, copy: torch.Tensor) -> torch.Tensor | None:
    """The scales that go with an int8 copy of the weight (the layer's per-channel scales), None for a float one."""
    return layer.scales if copy.dtype == torch.int8 else None


class TileKernel(LinearKernel):
    """bf16 activations on the weight's ``tile_layout`` (bf16, or int8 beside the layer's scales;
    csrc/tile_linear.c). With no ``larger`` kernel the tiles are the weight's only copy and serve steps of every
    size (AMX): past ``TILE_ROWS`` rows their blocked path, whose rounding pass also does SwiGLU's product or the
    residual add. Otherwise they serve steps of up to ``TILE_ROWS`` rows and ``larger`` the rest."""

    name = "tile"

    def __init__(self, tiles: torch.Tensor, larger: LinearKernel | None = None) -> None:
        self.tiles, self.larger = tiles, larger
        self.compiles_per_shape = larger is not None and larger.compiles_per_shape

    def _to_larger(self, x: torch.Tensor) -> LinearKernel | None:
        """The kernel that serves this step instead of the tiles, if any."""
        return self.larger if self.larger is not None and x.numel() > TILE_ROWS * x.shape[-1] else None

    def _blocked(self, x: torch.Tensor) -> bool:
        """Whether the tiles' blocked path multiplies this step: tiles only, more than ``TILE_ROWS`` rows."""
        return self.larger is None and x.numel() > TILE_ROWS * x.shape[-1]

    def matmul(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if (larger := self._to_larger(x)) is not None:
            return larger.matmul(layer, x)
        y = tile_matmul(x, self.tiles, _scales(layer, self.tiles))
        return y if layer.bias is None else y + layer.bias

    def silu_and_mul(self, layer: nn.Linear, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        if (larger := self._to_larger(x)) is not None:
            return larger.silu_and_mul(layer, x, ops)
        if self._blocked(x):
            flat = x.reshape(-1, x.shape[-1])
            return tile_silu_mul(flat, self.tiles, _scales(layer, self.tiles)).reshape(*x.shape[:-1], -1)
        return ops.silu_and_mul(self.matmul(layer, x))

    def add_into(self, layer: nn.Linear, x: torch.Tensor, residual: torch.Tensor) -> bool:
        if not (self._blocked(x) and layer.bias is None and residual.is_contiguous()):
            return False
        tile_add(x.reshape(-1, x.shape[-1]), self.tiles, residual.view(-1, residual.shape[-1]),
                 _scales(layer, self.tiles))
        return True

    def layouts(self) -> list[torch.Tensor]:
        return [self.tiles, *(self.larger.layouts() if self.larger is not None else ())]

    def small_step_copy(self) -> torch.Tensor | None:
        return None if self.larger is None else self.tiles

    def describe(self) -> str:
        if self.larger is None:
            return "tile (every step)"
        return f"tile (up to {TILE_ROWS} rows), then {self.larger.describe()}"


class StripKernel(LinearKernel):
    """fp32 activations on the weight's ``strip_layout`` (csrc/strip_linear.c, AVX-512) for steps of up to
    ``STRIP_ROWS`` rows; ``larger`` serves the rest."""

    name = "strip"

    def __init__(self, strips: torch.Tensor, larger: LinearKernel) -> None:
        self.strips, self.larger = strips, larger
        self.compiles_per_shape = larger.compiles_per_shape

    def matmul(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > STRIP_ROWS * x.shape[-1]:
            return self.larger.matmul(layer, x)
        y = strip_matmul(x, self.strips)
        return y if layer.bias is None else y + layer.bias

    def silu_and_mul(self, layer: nn.Linear, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        if x.numel() > STRIP_ROWS * x.shape[-1]:
            return self.larger.silu_and_mul(layer, x, ops)
        return ops.silu_and_mul(self.matmul(layer, x))

    def layouts(self) -> list[torch.Tensor]:
        return [self.strips, *self.larger.layouts()]

    def small_step_copy(self) -> torch.Tensor | None:
        return self.strips

    def describe(self) -> str:
        return f"strip (up to {STRIP_ROWS} rows), then {self.larger.describe()}"
