"""Builds the backend that a deployment's configuration names (config → Backend, in one place)."""

from __future__ import annotations

from backends.base import Backend
from gateway.config import DeploymentConfig


def build_backend(model_name: str, cfg: DeploymentConfig) -> Backend:
    """A not-yet-started backend for ``cfg`` serving the public name ``model_name``."""
    if cfg.kind == "native":
        from backends.native.backend import NativeBackend
        from backends.native.config import EngineConfig

        return NativeBackend(model_name, EngineConfig(
            model=cfg.model_path, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
            kv_cache_bytes=int(cfg.kv_cache_gb * (1 << 30)), max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, enable_prefix_caching=cfg.enable_prefix_caching,
            kernels=cfg.kernels))
    if cfg.kind == "openai":
        from backends.openai_http import OpenAIHTTPBackend

        return OpenAIHTTPBackend(model_name, cfg)
    if cfg.kind == "tgi":
        from backends.tgi import TGIBackend

        return TGIBackend(model_name, cfg)
    if cfg.kind == "lightllm":
        from backends.lightllm import LightLLMBackend

        return LightLLMBackend(model_name, cfg)
    if cfg.kind == "mii":
        from backends.deepspeed import MIIRestBackend

        return MIIRestBackend(model_name, cfg)
    if cfg.kind == "deepspeed":
        from backends.deepspeed import DeepSpeedInferenceBackend

        return DeepSpeedInferenceBackend(model_name, cfg)
    raise ValueError(f"deployment kind {cfg.kind!r} is not supported")
