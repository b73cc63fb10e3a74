"""Builds the backend that a deployment's configuration names (config → Backend, in one place)."""

from __future__ import annotations

from backends.base import Backend
from gateway.config import (
    DeepSpeedDeployment,
    DeploymentConfig,
    LightLLMDeployment,
    MIIDeployment,
    NativeDeployment,
    OpenAIDeployment,
    TGIDeployment,
)


def build_backend(model_name: str, cfg: DeploymentConfig) -> Backend:
    """A not-yet-started backend for ``cfg`` serving the public name ``model_name``."""
    # Imported per kind: a gateway of remote backends never loads torch's engine code, and vice versa.
    match cfg:
        case NativeDeployment():
            from backends.native.backend import NativeBackend

            return NativeBackend(model_name, cfg.engine_config())
        case OpenAIDeployment():
            from backends.openai_http import OpenAIHTTPBackend

            return OpenAIHTTPBackend(model_name, cfg)
        case TGIDeployment():
            from backends.tgi import TGIBackend

            return TGIBackend(model_name, cfg)
        case LightLLMDeployment():
            from backends.lightllm import LightLLMBackend

            return LightLLMBackend(model_name, cfg)
        case MIIDeployment():
            from backends.mii import MIIRestBackend

            return MIIRestBackend(model_name, cfg)
        case DeepSpeedDeployment():
            from backends.deepspeed_inference import DeepSpeedInferenceBackend

            return DeepSpeedInferenceBackend(model_name, cfg)
    raise ValueError(f"deployment kind {cfg.kind!r} is not supported")
