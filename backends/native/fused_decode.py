"""Small decode steps on CPU in one C call per step: the CPU's counterpart of CUDA graphs (cuda_graphs.py).

A decode step of one sequence reads every weight once, ~10 ms for SmolLM2's 270 MB of bf16 at this machine's
memory bandwidth; layer by layer from Python the step took ~14 ms: ~300 kernel calls through ctypes, each with
its tensor allocations and Python frames. csrc/decode_layers.c runs the same kernels in the same order over the
whole decoder stack, so a step gives bit for bit the eager path's logits and KV cache; the embedding lookup,
the final norm and the LM head stay here. It runs steps whose every sequence decodes one token, up to the rows
the linear layers' tile or strip layouts stream (``TILE_ROWS`` for AMX tiles, ``STRIP_ROWS`` for fp32 strips), on
one rank whose every layer has such a layout and runs on the C kernels; other steps, and every step with
``enforce_eager``, run eagerly.
"""

from __future__ import annotations

import ctypes

import torch

from backends.native.attention import Kernels
from backends.native.attention.cpu_attention import CpuAttention, CpuMetadata
from backends.native.batch import Batch
from backends.native.cpu_kernels import DTYPE_FLAGS, library
from backends.native.layer_ops import CpuLayerOps
from backends.native.linear import STRIP_ROWS, TILE_ROWS, Linear
from backends.native.model import LlamaModel

BF16_TILES, INT8_TILES, FP32_STRIPS = 0, 1, 2  # csrc/decode_layers.c's weight_kind


def _pointers(*names: str) -> type[ctypes.Structure]:
    return type("Pointers", (ctypes.Structure,), {"_fields_": [(name, ctypes.c_void_p) for name in names]})


LayerWeights = _pointers("input_norm", "post_norm", "qkv", "qkv_scales", "qkv_bias", "o", "o_scales", "gate_up",
                         "gate_up_scales", "down", "down_scales", "k_cache", "v_cache")
StepBuffers = _pointers("hidden", "residual", "qkv", "attn", "gate_up", "act")


class StepShape(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int64) for name in ("rows", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                                       "intermediate", "num_blocks", "block_size")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                *((name, ctypes.c_int32) for name in ("is_bf16", "weight_kind", "scales_bf16"))]


class StepTokens(ctypes.Structure):
    _fields_ = [("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("slot_mapping", ctypes.c_void_p),
                ("block_tables", ctypes.c_void_p), ("context_lens", ctypes.c_void_p), ("table_stride", ctypes.c_int64)]


def _weight_kind(linears: list[Linear]) -> int | None:
    """The one kind of small-step copy every linear layer has, or None."""
    if all(m.tiles is not None for m in linears):
        if all(m.is_int8 for m in linears):
            return INT8_TILES
        return None if any(m.is_int8 for m in linears) else BF16_TILES
    return FP32_STRIPS if all(m.strips is not None for m in linears) else None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecode:
    """The decoder stack of one model over one KV cache, ready to run small decode steps in one C call."""

    @classmethod
    def build(cls, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kernels: Kernels
              ) -> FusedDecode | None:
        """The fused path for ``model``, or None where it cannot run (see the module docstring)."""
        layers = model.layers
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        kind = _weight_kind(linears)
        if (model.tp.size != 1 or kind is None or kernels.layer_ops is not CpuLayerOps
                or not isinstance(kernels.attention, CpuAttention)):
            return None
        return cls(model, kv_caches, kind)

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kind: int) -> None:
        self.model = model
        self.max_rows = STRIP_ROWS if kind == FP32_STRIPS else TILE_ROWS
        cfg, attn, mlp = model.config, model.layers[0].self_attn, model.layers[0].mlp
        copy = "strips" if kind == FP32_STRIPS else "tiles"

        def weights(m: Linear) -> tuple[int, int | None]:
            return getattr(m, copy).data_ptr(), _ptr(m.scales) if m.is_int8 else None

        table = []
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            a, p = layer.self_attn, layer.mlp
            table.append(LayerWeights(layer.input_layernorm.weight.data_ptr(),
                                      layer.post_attention_layernorm.weight.data_ptr(),
                                      *weights(a.qkv_proj), _ptr(a.qkv_proj.bias), *weights(a.o_proj),
                                      *weights(p.gate_up_proj), *weights(p.down_proj),
                                      k_cache.data_ptr(), v_cache.data_ptr()))
        self.layers = (LayerWeights * len(table))(*table)
        scales = model.layers[0].self_attn.qkv_proj.scales if kind == INT8_TILES else None
        _, num_blocks, block_size, _ = kv_caches[0][0].shape
        self.shape = StepShape(0, cfg.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                               mlp.intermediate_size, num_blocks, block_size, cfg.rms_norm_eps, attn.scale,
                               DTYPE_FLAGS[model.embed_tokens.weight.dtype], kind,
                               scales is not None and scales.dtype == torch.bfloat16)
        self.sizes = {"qkv": attn.q_size + 2 * attn.kv_size, "attn": attn.q_size, "gate_up": 2 * mlp.intermediate_size,
                      "act": mlp.intermediate_size}

    def can_run(self, batch: Batch) -> bool:
        """Whether ``batch`` is a decode step this path runs: every sequence one token, few enough rows."""
        return batch.num_decodes == len(batch.query_lens) and 0 < batch.num_decodes <= self.max_rows

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: CpuMetadata) -> torch.Tensor:
        """The step's fp32 logits [rows of ``meta.logits_indices``, vocab], as ``LlamaModel.forward`` returns them
        (the runner pads those rows to a bucket, as for an eager step: an LM head without a small-step copy runs
        on oneDNN, compiled for the buckets only)."""
        model, rows = self.model, len(input_ids)
        hidden = model.embed_tokens(input_ids)
        residual = torch.empty_like(hidden)
        scratch = {name: hidden.new_empty(rows, size) for name, size in self.sizes.items()}
        cos, sin = (t.contiguous() for t in model.rotary.tables(positions))
        self.shape.rows = rows
        buffers = StepBuffers(hidden.data_ptr(), residual.data_ptr(), *(t.data_ptr() for t in scratch.values()))
        tokens = StepTokens(cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(), meta.decode_tables.data_ptr(),
                            meta.decode_context_lens.data_ptr(), meta.decode_tables.stride(0))
        if library().decode_layers(self.layers, len(self.layers), ctypes.byref(self.shape), ctypes.byref(buffers),
                                   ctypes.byref(tokens)):
            raise RuntimeError("decode_layers: a kernel refused the model's layout")
        return model.logits(hidden, residual, meta.logits_indices)
