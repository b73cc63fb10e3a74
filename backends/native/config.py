"""Model hyper-parameters, read from an HF ``config.json`` or from GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass
class ModelConfig:
    """Llama-family decoder shape. ``rope_scaling`` keeps HF's dict form (``rope_type`` + its fields)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once): for FLOP and bandwidth estimates."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size
        layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + h

    # ------------------------------------------------------------------------------------ builders
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from the dict of an HF ``config.json`` (Llama, Mistral or Qwen2 classes)."""
        arch = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_theta, rope_scaling = _rope_from_hf(cfg)
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v bias and says nothing in its config.
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            architecture=arch,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_list(eos),
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> ModelConfig:
        config = cls.from_hf_dict(json.loads((path / "config.json").read_text()))
        gen_path = path / "generation_config.json"
        if gen_path.exists():
            gen_eos = _as_list(json.loads(gen_path.read_text()).get("eos_token_id"))
            config.eos_token_ids = sorted(set(config.eos_token_ids) | set(gen_eos))
        return config

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> ModelConfig:
        """Build from GGUF key/values (``general.architecture`` prefixes the model keys)."""
        arch = meta["general.architecture"]

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        hidden = key("embedding_length")
        num_heads = key("attention.head_count")
        vocab = key("vocab_size") or len(meta["tokenizer.ggml.tokens"])
        rope_scaling = None
        if key("rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_layers=key("block_count"),
            num_heads=num_heads,
            num_kv_heads=key("attention.head_count_kv", num_heads),
            head_dim=key("attention.key_length") or hidden // num_heads,
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=key("rope.freq_base", 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=key("context_length", 4096),
            tie_word_embeddings=False,  # decided by the loader: tied when there is no output.weight
            attention_bias=arch == "qwen2",
            architecture=arch,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_list(eos),
        )


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Newer transformers put everything in ``rope_parameters``; older ones use ``rope_scaling`` + ``rope_theta``."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if params is not None and theta is None:
        theta = params.get("rope_theta")
    scaling = None
    if params is not None:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
            scaling["rope_type"] = rope_type
    return float(theta if theta is not None else 10000.0), scaling


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
