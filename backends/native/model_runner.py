"""Owns the model weights and the KV cache tensors; runs one flat batch. Makes no policy decisions."""

from __future__ import annotations

import logging

import torch

from backends.native.batch import AttentionMetadata, Batch, Workspace
from backends.native.config import ModelConfig
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


ATTENTION_PATHS = ("auto", "torch")


def paged_kernels(attention: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                  block_size: int) -> tuple[bool, bool]:
    """Whether (decodes, prefills) run on paged kernels. ``auto``: on CUDA, Triton for decodes (SDPA for
    prefills); on CPU, the C kernels for both when they build here and take this layout. ``torch``: the
    pure-torch paths everywhere."""
    if attention not in ATTENTION_PATHS:
        raise ValueError(f"unknown attention path {attention!r}; choose one of {ATTENTION_PATHS}")
    if attention == "torch":
        return False, False
    if device.type == "cuda":
        return True, False
    from backends.native import cpu_attention

    cpu = cpu_attention.supports(dtype, config.num_heads, config.num_kv_heads, config.head_dim, block_size)
    return cpu, cpu


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, attention: str = "auto") -> None:
        self.model = model
        cfg = model.config
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.paged_decode, self.paged_prefill = paged_kernels(attention, cfg, self.dtype, self.device, block_size)
        self.packed_weights = model.pack_linear_weights()
        self.workspace = Workspace()
        shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)  # head-major: see attention.py
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(cfg.num_layers)]

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, *, max_model_len: int, dtype: torch.dtype,
                        device: torch.device, num_blocks: int, block_size: int, attention: str = "auto"
                        ) -> ModelRunner:
        model = build_model(checkpoint.config, max_model_len, torch.float32, device)
        model.load_weights(checkpoint.tensors())
        return cls(model.to(dtype=dtype), num_blocks, block_size, attention)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor:
        """Run one step; returns fp32 logits [num_sampled, vocab] for the sequences that sample."""
        meta = AttentionMetadata.build(batch, self.block_size, self.num_blocks, self.device, self.workspace,
                                       self.paged_decode, self.paged_prefill)
        input_ids = torch.tensor(batch.token_ids, dtype=torch.int64, device=self.device)
        positions = torch.tensor(batch.positions, dtype=torch.int64, device=self.device)
        return self.model(input_ids, positions, self.kv_caches, meta)
