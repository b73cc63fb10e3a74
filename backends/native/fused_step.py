"""CPU steps in one C call: the CPU's counterpart of CUDA graphs (cuda_graphs.py).

A decode step of one sequence reads every weight once; layer by layer from Python it also made hundreds of
kernel calls through ctypes, each with its tensor allocations and Python frames, while the other OpenMP threads
wait, and large steps lost time the same way. csrc/step_layers.c runs the same kernels in the same order over the whole
decoder stack, so a step gives bit for bit the eager path's logits and KV cache; the embedding lookup, the final
norm and the LM head stay here. It runs any mix of decodes and prefill chunks up to the rows the linear layers'
small-step copies serve (``TILE_ROWS`` for AMX tiles, ``STRIP_ROWS`` for fp32 strips), and steps of any size where
every linear weight's only copy is its tile layout (AMX, bf16 or int8; the blocked path of csrc/tile_linear.c),
on one rank whose every layer runs on the C kernels; other steps, and every step with ``enforce_eager``, run
eagerly.
"""

from __future__ import annotations

import ctypes

import torch

from backends.native.attention import Kernels
from backends.native.attention.cpu_attention import CpuAttention, CpuMetadata, amx_prefill_runs
from backends.native.batch import Batch
from backends.native.cpu_kernels import DTYPE_FLAGS, kv_format, library
from backends.native.layer_ops import CpuLayerOps
from backends.native.linear import Linear
from backends.native.linear_kernels import STRIP_ROWS, TILE_ROWS, StripKernel, TileKernel
from backends.native.model import LlamaModel

BF16_TILES, INT8_TILES, FP32_STRIPS = 0, 1, 2  # csrc/step_layers.c's weight_kind


def _pointers(*names: str) -> type[ctypes.Structure]:
    return type("Pointers", (ctypes.Structure,), {"_fields_": [(name, ctypes.c_void_p) for name in names]})


LayerWeights = _pointers("input_norm", "post_norm", "qkv", "qkv_scales", "qkv_bias", "o", "o_scales", "gate_up",
                         "gate_up_scales", "down", "down_scales", "k_cache", "v_cache")
StepBuffers = _pointers("hidden", "residual", "qkv", "attn", "gate_up", "act")


class StepShape(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int64) for name in ("rows", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                                       "intermediate", "num_blocks", "block_size")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                *((name, ctypes.c_int32) for name in ("is_bf16", "weight_kind", "scales_bf16", "amx_prefill",
                                                       "kv_format"))]


class StepTokens(ctypes.Structure):
    _fields_ = [("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("slot_mapping", ctypes.c_void_p),
                ("num_decodes", ctypes.c_int64), ("decode_table_stride", ctypes.c_int64),
                ("decode_tables", ctypes.c_void_p), ("decode_context_lens", ctypes.c_void_p),
                ("num_prefills", ctypes.c_int64), ("prefill_table_stride", ctypes.c_int64),
                *((name, ctypes.c_void_p) for name in ("prefill_tables", "prefill_query_starts", "prefill_query_lens",
                                                       "prefill_context_lens"))]


def _weight_kind(linears: list[Linear]) -> int | None:
    """The one kind of small-step copy (or tile layout) every linear layer's kernel reads, or None."""
    if all(isinstance(m.kernel, TileKernel) for m in linears):
        if all(m.is_int8 for m in linears):
            return INT8_TILES
        return None if any(m.is_int8 for m in linears) else BF16_TILES
    return FP32_STRIPS if all(isinstance(m.kernel, StripKernel) for m in linears) else None


def _copy(m: Linear) -> torch.Tensor:
    """The tiles or strips the C step reads for ``m`` (a tile or strip kernel's own layout)."""
    kernel = m.kernel
    if isinstance(kernel, TileKernel):
        return kernel.tiles
    assert isinstance(kernel, StripKernel)  # _weight_kind found tiles or strips in every layer
    return kernel.strips


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def fused_rows(fused: FusedStep | None) -> int | None:
    """The most rows of a step ``fused`` runs in one C call (0 without it; None: any number): a simulator's
    profile charges the others the launches of a step run layer by layer."""
    return 0 if fused is None else fused.max_rows


class FusedStep:
    """The decoder stack of one model over one KV cache, ready to run steps in one C call."""

    @classmethod
    def build(cls, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kernels: Kernels
              ) -> FusedStep | None:
        """The fused path for ``model``, or None where it cannot run (see the module docstring)."""
        layers = model.layers
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        kind = _weight_kind(linears)
        if (model.tp.size != 1 or model.stage.count != 1 or kind is None or kernels.layer_ops is not CpuLayerOps
                or not isinstance(kernels.attention, CpuAttention)):
            return None
        # the eager path's blocked steps (Linear.with_residual, GateUpLinear.silu_and_mul), which the C path follows
        any_rows = kind != FP32_STRIPS and all(m.layout_only for m in linears)
        return cls(model, kv_caches, kind, kernels.attention, any_rows)

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kind: int,
                 attention: CpuAttention, any_rows: bool) -> None:
        assert model.embed_tokens is not None  # one stage (build): the whole model
        self.model, self.embed = model, model.embed_tokens
        self.max_rows = None if any_rows else STRIP_ROWS if kind == FP32_STRIPS else TILE_ROWS
        cfg, attn, mlp = model.config, model.layers[0].self_attn, model.layers[0].mlp

        def weights(m: Linear) -> tuple[int, int | None]:
            return _copy(m).data_ptr(), _ptr(m.scales) if m.is_int8 else None

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
        dtype = self.embed.weight.dtype
        hkv, num_blocks, block_size, _ = kv_caches[0][0].shape
        amx = attention.amx_prefill and amx_prefill_runs(dtype, attn.scale, attn.num_heads, hkv, attn.head_dim,
                                                          block_size)
        self.shape = StepShape(0, cfg.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                               mlp.intermediate_size, num_blocks, block_size, cfg.rms_norm_eps, attn.scale,
                               DTYPE_FLAGS[dtype], kind, scales is not None and scales.dtype == torch.bfloat16, amx,
                               kv_format(kv_caches[0][0]))
        self.sizes = {"qkv": attn.q_size + 2 * attn.kv_size, "attn": attn.q_size, "gate_up": 2 * mlp.intermediate_size,
                      "act": mlp.intermediate_size}

    def can_run(self, batch: Batch) -> bool:
        """Whether ``batch`` is a step this path runs: any mix of decodes and prefill chunks, few enough rows for
        the small-step copies (any number where the tile layouts are the weights' only copies)."""
        rows = len(batch.token_ids)
        return rows > 0 and (self.max_rows is None or rows <= self.max_rows)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: CpuMetadata) -> torch.Tensor:
        """The step's fp32 logits [rows of ``meta.logits_indices``, vocab], as ``LlamaModel.forward`` returns them
        (the runner pads those rows to a bucket, as for an eager step: an LM head without a small-step copy runs
        on oneDNN, compiled for the buckets only)."""
        model, rows = self.model, len(input_ids)
        hidden = self.embed(input_ids)
        residual = torch.empty_like(hidden)
        blocked = self.max_rows is None and rows > TILE_ROWS  # step_layers.c's blocked steps
        scratch = {name: hidden.new_empty(0 if name == "gate_up" and blocked else rows, size)
                   for name, size in self.sizes.items()}
        cos, sin = (t.contiguous() for t in model.rotary.tables(positions))
        self.shape.rows = rows
        buffers = StepBuffers(hidden.data_ptr(), residual.data_ptr(), *(t.data_ptr() for t in scratch.values()))
        tokens = StepTokens(cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
                            meta.num_decodes, meta.decode_tables.stride(0), meta.decode_tables.data_ptr(),
                            meta.decode_context_lens.data_ptr(),
                            len(meta.prefill_query_lens), meta.prefill_tables.stride(0), meta.prefill_tables.data_ptr(),
                            meta.prefill_query_starts.data_ptr(), meta.prefill_query_lens.data_ptr(),
                            meta.prefill_context_lens.data_ptr())
        if library().step_layers(self.layers, len(self.layers), ctypes.byref(self.shape), ctypes.byref(buffers),
                                 ctypes.byref(tokens)):
            raise RuntimeError("step_layers: a kernel refused the model's layout")
        if blocked:  # the layers added their outputs into the residual stream
            return model.logits(residual, None, meta.logits_indices)
        return model.logits(hidden, residual, meta.logits_indices)
