"""Owns the model weights and the KV cache tensors; runs one flat batch. Makes no policy decisions."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from backends.native.batch import AttentionMetadata, Batch, Workspace
from backends.native.config import ModelConfig
from backends.native.layer_ops import CpuLayerOps, TorchLayerOps
from backends.native.model import LlamaModel
from backends.native.rotary import RotaryEmbedding
from backends.native.weights import Checkpoint

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def build_model(config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    """An uninitialised model on ``device`` (parameters are filled by ``load_weights`` or by the caller)."""
    with torch.device("meta"):
        model = LlamaModel(config, max_positions)
    model = model.to_empty(device=device)
    model.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling, device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype=dtype).eval().requires_grad_(False)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


KERNEL_CHOICES = ("auto", "torch")


@dataclass(frozen=True)
class Kernels:
    """What one model runs on besides matmuls."""

    paged_decode: bool  # decodes on a paged attention kernel (else the torch gather path)
    paged_prefill: bool  # prefill chunks on the paged causal kernel (else SDPA)
    layer_ops: type  # TorchLayerOps or CpuLayerOps (layer_ops.py)

    def describe(self) -> str:
        """For the start-up log line."""
        attention = {(True, True): "paged attention", (True, False): "paged decode attention, SDPA prefill"}.get(
            (self.paged_decode, self.paged_prefill), "torch attention")
        return f"{attention}, {'C' if self.layer_ops is CpuLayerOps else 'torch'} layer ops"


def choose_kernels(kernels: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                   block_size: int) -> Kernels:
    """``auto``: on CUDA, Triton for decodes (SDPA for prefills, torch layer ops); on CPU, the C kernels
    for attention and layer ops where they build here and take this layout. ``torch``: pure torch everywhere."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernels {kernels!r}; choose one of {KERNEL_CHOICES}")
    if kernels == "torch":
        return Kernels(False, False, TorchLayerOps)
    if device.type == "cuda":
        return Kernels(True, False, TorchLayerOps)
    from backends.native import cpu_attention

    paged = cpu_attention.supports(dtype, config.num_heads, config.num_kv_heads, config.head_dim, block_size)
    return Kernels(paged, paged, CpuLayerOps if CpuLayerOps.available(dtype, device) else TorchLayerOps)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kernels: str = "auto") -> None:
        self.model = model
        cfg = model.config
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kernels = choose_kernels(kernels, cfg, self.dtype, self.device, block_size)
        model.use_layer_ops(self.kernels.layer_ops)
        self.packed_weights = model.pack_linear_weights()
        self.workspace = Workspace()
        shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)  # head-major: see attention.py
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(cfg.num_layers)]

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, *, max_model_len: int, dtype: torch.dtype,
                        device: torch.device, num_blocks: int, block_size: int, kernels: str = "auto"
                        ) -> ModelRunner:
        model = build_model(checkpoint.config, max_model_len, torch.float32, device)
        model.load_weights(checkpoint.tensors())
        return cls(model.to(dtype=dtype), num_blocks, block_size, kernels)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor:
        """Run one step; returns fp32 logits [num_sampled, vocab] for the sequences that sample."""
        meta = AttentionMetadata.build(batch, self.block_size, self.num_blocks, self.device, self.workspace,
                                       self.kernels.paged_decode, self.kernels.paged_prefill)
        input_ids = torch.tensor(batch.token_ids, dtype=torch.int64, device=self.device)
        positions = torch.tensor(batch.positions, dtype=torch.int64, device=self.device)
        return self.model(input_ids, positions, self.kv_caches, meta)
