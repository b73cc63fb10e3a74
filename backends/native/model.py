"""Llama-family decoder (Llama, Mistral, Qwen2): RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Operates on the flat token layout [T, hidden] of one engine step; q/k/v and gate/up projections are
fused into one weight each (gate/up: on AMX CPUs silu(gate) * up comes out of the tile kernel's rounding
pass; packed for oneDNN in bf16 elsewhere, two matmuls chained by their epilogues; linear_kernels.py).
``load_weights`` takes tensors under HF names and fills the fused layout.
Under tensor parallelism (parallel.py) each rank builds its shard of every layer and loads its slice of
every tensor; the all-reduces and the logits gather are the model's only collectives. Under pipeline parallelism
a rank builds and loads only its stage's layers (the embedding on the first stage, the norm and LM head on the
last); its forward starts from the previous stage's hidden states and ends with its own.
The residual stream travels beside the hidden states, so each RMSNorm adds it in the same pass (as vLLM
does), unless the projection before it added it in its own rounding pass (``Linear.with_residual``, AMX tiles); the elementwise ops come from layer_ops.py (torch, or C kernels on CPU) and attention from an
attention backend (attention/), both chosen per model by ``attention.choose_kernels``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from backends.native.attention import AttentionBackend, Kernels, StepMetadata
from backends.native.config import ModelConfig
from backends.native.host_memory import available_memory
from backends.native.layer_ops import LayerOps, TorchLayerOps
from backends.native.linear import GateUpLinear, Int8Rows, Linear, SmallStepCopy
from backends.native.linear_kernels import (
    can_pack,
    can_strip,
    can_tile,
    layout_serves_all_rows,
)
from backends.native.parallel import PipelineStage, TensorParallel
from backends.native.rotary import RotaryEmbedding
from backends.native.weights import Q8_0Tensor

log = logging.getLogger(__name__)

# The small-step copies of the linear weights (tiles, strips) double their memory: kept only where they take at
# most this share of the memory available when the model is packed, so they never crowd out the KV cache or a
# larger model.
SMALL_STEP_COPY_SHARE = 0.25


class RMSNorm(nn.Module):
    ops: LayerOps = TorchLayerOps

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised x + residual, the new residual x + residual); see ``TorchLayerOps.add_rms_norm``."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    ops: LayerOps = TorchLayerOps
    backend: AttentionBackend  # set by ``LlamaModel.use_kernels``

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        kv_heads = tp.kv_heads(cfg.num_kv_heads)
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, kv_heads.stop - kv_heads.start
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)  # row-parallel: a partial sum per rank

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: StepMetadata, residual: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output and the residual stream, for the next norm to add (see ``Linear.with_residual``)."""
        q, k, v = self.ops.rotary_store_kv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, *rope, *kv_cache,
                                           meta.slot_mapping)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale).flatten(1)
        if self.tp.size == 1:
            return self.o_proj.with_residual(out, residual)
        return self.tp.all_reduce(self.o_proj(out)), residual  # the ranks' partial sums first


class MLP(nn.Module):
    ops: LayerOps = TorchLayerOps

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = cfg.intermediate_size // tp.size
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = Linear(self.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output and the residual stream, for the next norm to add (see ``Linear.with_residual``)."""
        act = self.gate_up_proj.silu_and_mul(x, self.ops)
        if self.tp.size == 1:
            return self.down_proj.with_residual(act, residual)
        return self.tp.all_reduce(self.down_proj(act)), residual


class VocabEmbedding(nn.Module):
    """This rank's rows of the embedding table; a lookup sums every rank's rows (zeros elsewhere)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.rows = tp.padded_rows(cfg.vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows.stop - self.rows.start, cfg.hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.rows.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, residual, rope, kv_cache, meta):
        """(output, residual) for the next norm to add; residual None where the layer added them already."""
        x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(*self.self_attn(x, rope, kv_cache, meta, residual))
        return self.mlp(x, residual)


Hidden = tuple[torch.Tensor, torch.Tensor | None]  # hidden states and residual stream between stages


class LlamaModel(nn.Module):
    """Decoder stack plus LM head: one rank's shard of its stage (the whole model when ``tp.size`` is 1 and there
    is one stage). ``forward`` returns fp32 logits for ``meta.logits_indices`` only, on the last stage's first
    rank (None on its other ranks); an earlier stage returns its hidden states for the next."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, tp: TensorParallel | None = None,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TensorParallel()
        self.stage = stage = stage or PipelineStage(layers=range(cfg.num_layers))
        self.embed_tokens: VocabEmbedding | None = VocabEmbedding(cfg, tp) if stage.is_first else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in stage.layers)
        self.norm: RMSNorm | None = None
        self.lm_head: Linear | None = None
        if stage.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            vocab = tp.padded_rows(cfg.vocab_size)
            self.lm_head = Linear(cfg.hidden_size, vocab.stop - vocab.start, bias=False)  # vocab-parallel
            if (tied := self.tied_head()) is not None:
                table, head = tied
                head.weight = table.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling, device=next(self.parameters()).device)

    @property
    def head_is_table(self) -> bool:
        """Whether the LM head reads the embedding table itself (tied, and both on this stage)."""
        return self.tied_head() is not None

    def tied_head(self) -> tuple[VocabEmbedding, Linear] | None:
        """(the embedding table, the LM head) where the head reads the table itself, else None."""
        if self.config.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            return self.embed_tokens, self.lm_head
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: StepMetadata,
                hidden: Hidden | None = None) -> torch.Tensor | Hidden | None:
        """``hidden``: the previous stage's output, where this is not the first stage."""
        if hidden is None:
            assert self.embed_tokens is not None, "only the first stage starts from token ids"
            hidden = self.embed_tokens(input_ids), None
        x, residual = hidden
        rope = self.rotary.tables(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        if self.lm_head is None:
            return x, residual
        return self.logits(x, residual, meta.logits_indices)

    def logits(self, x: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits of ``rows`` (int64 indices) from the last layer's output and residual stream (None:
        added into the output already)."""
        assert self.norm is not None and self.lm_head is not None, "only the last stage has the LM head"
        x, _ = self.norm(x[rows], None if residual is None else residual[rows])
        logits = self.tp.gather_columns(self.lm_head(x))
        return None if logits is None else logits[:, :self.config.vocab_size].float()

    def use_kernels(self, kernels: Kernels) -> None:
        """Run every layer's attention on ``kernels.attention`` and its elementwise ops on ``kernels.layer_ops``."""
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP):
                module.ops = kernels.layer_ops
            if isinstance(module, Attention):
                module.backend = kernels.attention

    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds (oneDNN-packed copies, tile layouts and small-step copies included)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        return total + sum(t.numel() * t.element_size() for m in self._linears() for t in m.kernel.layouts())

    def small_step_copy_bytes(self) -> int:
        """Bytes of the linear weights' second copies for small steps, bf16/int8 tiles or fp32 strips (0 if none): not
        the layouts that are a weight's only copy."""
        return sum(copy.numel() * copy.element_size() for m in self._linears()
                   if (copy := m.kernel.small_step_copy()) is not None)

    def linear_kernels(self) -> dict[str, str]:
        """Each kind of linear layer (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, ``lm_head``) and the
        kernel it multiplies with, as ``pack_linear_weights`` chose it (for ``GET /info`` and the start-up log)."""
        kinds: dict[str, set[str]] = {}
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                kinds.setdefault(name.rpartition(".")[2], set()).add(module.kernel.describe())
        return {kind: " | ".join(sorted(kernels)) for kind, kernels in kinds.items()}

    def _linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    # ----------------------------------------------------------------------------------- weights
    def pack_linear_weights(self) -> bool:
        """Choose every linear layer's kernel once, laying its weight out for the fastest matmul this build has (CPU,
        fp32/bf16 models): after loading and casting, since the new layouts replace the weights. On CPUs with AMX
        tiles, the bf16 and int8 weights of a bf16 model whose tile layout serves steps of every size get only that
        (linear_kernels.py). The other float weights are packed for oneDNN; the other weights, float or int8, get a
        second copy for small steps where a kernel for it runs here: tiles for bf16 activations (on AMX, or
        AVX512-BF16 vectors), AVX-512 strips for fp32, kept when they take at most ``SMALL_STEP_COPY_SHARE`` of the
        memory available (the container's, where it has a limit). The choice is logged once.
        Returns whether it laid them out (False where this build has no CPU layout for their dtype)."""
        weight = next(self.parameters())  # every float weight has the model's dtype
        laid_out = can_pack(weight.dtype, weight.device)
        copies = self._lay_out_linears(weight.dtype) if laid_out else "none"
        log.info("linear kernels: %s (small-step copies: %s)",
                 "; ".join(f"{kind}: {kernel}" for kind, kernel in self.linear_kernels().items()), copies)
        return laid_out

    def _lay_out_linears(self, dtype: torch.dtype) -> str:
        """``pack_linear_weights`` for a model of ``dtype`` on a CPU that packs it; says what became of the small-step
        copies."""
        linears = self._linears()
        tied = self.lm_head if self.head_is_table else None
        for module in linears:
            if layout_serves_all_rows(module.weight, dtype):  # the activations are the embeddings' dtype
                # a tied head keeps the table the lookup reads; a tied int8 head's weight is its own copy
                module.use_layout_only(keep_weight=module is tied and not module.is_int8)
        linears = [m for m in linears if not m.layout_only]
        small_steps: SmallStepCopy = "tiles" if dtype == torch.bfloat16 else "strips"
        can_copy = can_tile if small_steps == "tiles" else can_strip
        copied = {m for m in linears if can_copy(m.weight)}
        copies = "none"
        if copied:
            extra = sum(m.weight.numel() * m.weight.element_size() for m in copied)
            available = available_memory()
            fits = extra <= SMALL_STEP_COPY_SHARE * available
            copies = (f"{small_steps} {'kept' if fits else 'left out, too large'} ({extra / 1e6:.0f} MB, "
                      f"{available / 1e6:.0f} MB available)")
            copied = copied if fits else set()
        for module in linears:
            module.pack(small_steps if module in copied else None, keep_weight=module is tied)
        return copies

    def to_int8(self) -> None:
        """Weight-only int8 for every linear layer, before ``load_weights`` fills them; a LM head tied to the
        embedding table gets its own int8 copy of it (the lookup still reads the float table)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.to_int8()

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor | Q8_0Tensor]]) -> None:
        """Copy HF-named tensors into this module: this rank's slice of each, q/k/v and gate/up fused, int8
        layers quantised per output channel (Q8_0 tensors straight from their blocks). Every parameter must be set."""
        params = dict(self.named_parameters(remove_duplicate=False))
        head_reads_table = self.head_is_table
        unset = {name for name in params if not (head_reads_table and name.startswith("lm_head."))}
        for hf_name, tensor in tensors:
            if not self.holds(hf_name):
                continue  # another stage's, or not a weight
            name, rows, dim, part = self._target(hf_name)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name} has no place in the model")
            if params[name].dtype == torch.int8:
                q = tensor.int8_rows() if isinstance(tensor, Q8_0Tensor) else Int8Rows.quantize(tensor)
                scales = name.removesuffix("weight") + "scales"  # a whole row's scale serves any slice of it
                _copy(params[name], rows, q.values, dim, part, hf_name)
                _copy(params[scales], rows, q.scales, 0, part if dim == 0 else None, hf_name)
                unset.discard(scales)
            else:
                _copy(params[name], rows, tensor.float() if isinstance(tensor, Q8_0Tensor) else tensor, dim, part,
                      hf_name)
            unset.discard(name)
        if unset:
            raise ValueError(f"checkpoint is missing weights for: {sorted(unset)[:5]}")
        if (tied := self.tied_head()) is not None and tied[1].is_int8:
            table, head = tied
            q = Int8Rows.quantize(table.weight)
            _copy(head.weight, None, q.values, 0, None, "lm_head.weight")
            _copy(head.scales, None, q.scales, 0, None, "lm_head.scales")

    def holds(self, hf_name: str) -> bool:
        """Whether this rank's stage takes the HF tensor ``hf_name`` (checkpoints skip the others unread)."""
        name = hf_name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):
            return False  # recomputed from the config
        if name.startswith("layers."):
            return int(name.split(".")[1]) in self.stage.layers
        if name == "embed_tokens.weight":  # a tied head on the last stage is its own copy of the table
            return self.embed_tokens is not None or (self.lm_head is not None and self.config.tie_word_embeddings)
        if name == "lm_head.weight":  # some checkpoints store a tied head's copy too
            return self.lm_head is not None and not self.config.tie_word_embeddings
        if name == "norm.weight":
            return self.norm is not None
        return True  # not a name of this architecture: ``load_weights`` says so

    def _target(self, hf_name: str) -> tuple[str, slice | None, int, slice | None]:
        """Map an HF name this rank ``holds`` to (our parameter, the rows it fills in a fused parameter or None for
        all, and the dimension and slice of the HF tensor this rank holds, or None for all of it)."""
        name = hf_name.removeprefix("model.")
        if name.startswith("layers."):  # the checkpoint's layer index -> this stage's
            _, index, rest = name.split(".", 2)
            name = f"layers.{int(index) - self.stage.layers.start}.{rest}"
        elif name == "embed_tokens.weight" and self.embed_tokens is None:
            name = "lm_head.weight"
        cfg, tp, d = self.config, self.tp, self.config.head_dim
        q, kv, inter = self.layers[0].self_attn.q_size, self.layers[0].self_attn.kv_size, cfg.intermediate_size // tp.size
        q_heads, kv_heads = tp.rows(cfg.num_heads), tp.kv_heads(cfg.num_kv_heads)
        q_part, kv_part = slice(q_heads.start * d, q_heads.stop * d), slice(kv_heads.start * d, kv_heads.stop * d)
        mlp_part = tp.rows(cfg.intermediate_size)
        parts = {  # HF part: (our part, rows of it, dim and slice of the HF tensor)
            "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q), 0, q_part),
            "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv), 0, kv_part),
            "self_attn.v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv), 0, kv_part),
            "self_attn.o_proj": ("self_attn.o_proj", None, 1, q_part),
            "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, inter), 0, mlp_part),
            "mlp.up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter), 0, mlp_part),
            "mlp.down_proj": ("mlp.down_proj", None, 1, mlp_part),
        }
        for part, (target, rows, dim, shard) in parts.items():
            if f".{part}." in name:
                return name.replace(part, target), rows, dim, shard if tp.size > 1 else None
        if name in ("embed_tokens.weight", "lm_head.weight") and tp.size > 1:
            return name, None, 0, tp.padded_rows(cfg.vocab_size)
        return name, None, 0, None


def _copy(param: torch.Tensor, rows: slice | None, tensor: torch.Tensor, dim: int, part: slice | None,
          hf_name: str) -> None:
    """``tensor``'s slice ``part`` along ``dim`` (all of it for None) into ``rows`` of ``param`` (all for None)."""
    dest = param if rows is None else param[rows]
    if part is not None:  # the last vocabulary shard may run past the table: its rest is padding
        tensor = tensor.narrow(dim, part.start, max(min(part.stop, tensor.shape[dim]) - part.start, 0))
    padded = part is not None and part.stop > part.start + tensor.shape[dim]
    if dest.shape != tensor.shape and not (padded and dest.shape[1:] == tensor.shape[1:]):
        raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
    with torch.no_grad():
        dest[:tensor.shape[0]].copy_(tensor)
        dest[tensor.shape[0]:].zero_()


def dummy_tensors(config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights under HF names (vLLM's ``load_format: dummy``): matrices and biases N(0, 0.02), norms 1.
    Each whole tensor is drawn from ``seed`` before any rank slices it, so every tensor-parallel size
    serves the same model; one tensor exists at a time."""
    generator = torch.Generator(device).manual_seed(seed)
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=dtype, device=device).mul_(0.02)

    yield "model.embed_tokens.weight", draw(config.vocab_size, h)
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)),
                            ("self_attn.v_proj", (kv, h))):
            yield f"{prefix}{name}.weight", draw(*shape)
            if config.attention_bias:
                yield f"{prefix}{name}.bias", draw(shape[0])
        yield f"{prefix}self_attn.o_proj.weight", draw(h, q)
        yield f"{prefix}mlp.gate_proj.weight", draw(inter, h)
        yield f"{prefix}mlp.up_proj.weight", draw(inter, h)
        yield f"{prefix}mlp.down_proj.weight", draw(h, inter)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield f"{prefix}{norm}.weight", torch.ones(h, dtype=dtype, device=device)
    yield "model.norm.weight", torch.ones(h, dtype=dtype, device=device)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", draw(config.vocab_size, h)
