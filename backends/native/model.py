"""Llama-family decoder (Llama, Mistral, Qwen2): RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Operates on the flat token layout [T, hidden] of one engine step; q/k/v and gate/up projections are
fused into one matmul each. ``load_weights`` takes tensors under HF names and fills the fused layout.
The residual stream travels beside the hidden states, so each RMSNorm adds it in the same pass (as vLLM
does); the elementwise ops come from layer_ops.py (torch, or C kernels on CPU) and attention from an
attention backend (attention/), both chosen per model by ``attention.choose_kernels``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from backends.native.attention import AttentionBackend, Kernels, StepMetadata
from backends.native.config import ModelConfig
from backends.native.layer_ops import TorchLayerOps
from backends.native.linear import Linear, can_pack
from backends.native.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    ops = TorchLayerOps

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised x + residual, the new residual x + residual); see ``TorchLayerOps.add_rms_norm``."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    ops = TorchLayerOps
    backend: AttentionBackend  # set by ``LlamaModel.use_kernels``

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: StepMetadata) -> torch.Tensor:
        q, k, v = self.ops.rotary_store_kv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, *rope, *kv_cache,
                                           meta.slot_mapping)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    ops = TorchLayerOps

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, rope, kv_cache, meta):
        x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, meta), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Decoder stack plus LM head. ``forward`` returns fp32 logits for ``meta.logits_indices`` only."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling, device=self.embed_tokens.weight.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: StepMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.tables(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        x, _ = self.norm(x[meta.logits_indices], residual[meta.logits_indices])
        return self.lm_head(x).float()

    def use_kernels(self, kernels: Kernels) -> None:
        """Run every layer's attention on ``kernels.attention`` and its elementwise ops on ``kernels.layer_ops``."""
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP):
                module.ops = kernels.layer_ops
            if isinstance(module, Attention):
                module.backend = kernels.attention

    # ----------------------------------------------------------------------------------- weights
    def pack_linear_weights(self) -> bool:
        """Repack every linear weight for oneDNN where this build can (CPU, fp32/bf16): after loading
        and casting, since the packed copies replace the weights. Returns whether it packed."""
        weight = self.embed_tokens.weight
        if not can_pack(weight.dtype, weight.device):
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(keep_weight=module is self.lm_head and self.config.tie_word_embeddings)
        return True

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights (vLLM's ``load_format: dummy``), drawn in place on the model's device from ``seed``:
        matrices and biases N(0, 0.02), norms 1. For measuring an architecture without its checkpoint."""
        generator = torch.Generator(self.embed_tokens.weight.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into this module, fusing q/k/v and gate/up; every parameter must be set."""
        params = dict(self.named_parameters(remove_duplicate=False))
        unset = {name for name in params if not (name == "lm_head.weight" and self.config.tie_word_embeddings)}
        for hf_name, tensor in tensors:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            name, offset = self._target(hf_name)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some checkpoints store the tied copy too
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name} has no place in the model")
            param = params[name]
            with torch.no_grad():
                if offset is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
                    param.copy_(tensor)
                else:
                    param[offset: offset + tensor.shape[0]].copy_(tensor)
            unset.discard(name)
        if unset:
            raise ValueError(f"checkpoint is missing weights for: {sorted(unset)[:5]}")

    def _target(self, hf_name: str) -> tuple[str, int | None]:
        """Map an HF name to (our parameter name, row offset inside a fused parameter or None)."""
        name = hf_name.removeprefix("model.")
        attn = self.layers[0].self_attn
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0),
            "self_attn.k_proj": ("self_attn.qkv_proj", attn.q_size),
            "self_attn.v_proj": ("self_attn.qkv_proj", attn.q_size + attn.kv_size),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0),
            "mlp.up_proj": ("mlp.gate_up_proj", self.config.intermediate_size),
        }
        for part, (target, offset) in fused.items():
            if f".{part}." in name:
                return name.replace(part, target), offset
        return name, None
