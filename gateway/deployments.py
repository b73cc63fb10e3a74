"""A deployment as the gateway runs it (one backend behind a model name, with its admission, health and
breaker state), and the backend its configuration names (config → Backend, in one place)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backends.base import Backend
from gateway.breaker import CircuitBreaker
from gateway.config import (
    DeepSpeedDeployment,
    DeploymentConfig,
    LightLLMDeployment,
    MIIDeployment,
    NativeDeployment,
    OpenAIDeployment,
    TGIDeployment,
)
from gateway.limits import ConcurrencyLimiter

EWMA_ALPHA = 0.2  # weight of the newest time to first token in a deployment's running estimate


@dataclass(eq=False, kw_only=True)
class Deployment:
    """One backend behind a model name: its admission limiter, health, breaker and latency estimate."""

    name: str
    backend: Backend
    limiter: ConcurrencyLimiter  # from the deployment's max_concurrency and max_queue
    weight: float = 1.0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    first_token_timeout_s: float | None = None
    total_timeout_s: float | None = None
    healthy: bool = True
    ttft_ewma_s: float | None = None  # None until the first answer
    config: Any = None  # the configuration it was built from (reported by GET /info), if any

    @property
    def outstanding(self) -> int:
        return self.limiter.in_flight + self.limiter.waiting

    @property
    def available(self) -> bool:
        return self.healthy and self.breaker.available()

    def observe_ttft(self, seconds: float) -> None:
        prev = self.ttft_ewma_s
        self.ttft_ewma_s = seconds if prev is None else prev + EWMA_ALPHA * (seconds - prev)


def build_backend(model_name: str, cfg: DeploymentConfig) -> Backend:
    """A not-yet-started backend for ``cfg`` serving the public name ``model_name``."""
    # Imported per kind: a gateway of remote backends never loads torch's engine code, and vice versa.
    match cfg:
        case NativeDeployment():
            from backends.native.backend import NativeBackend

            return NativeBackend(model_name, cfg.engine_config())
        case OpenAIDeployment():
            from backends.openai_http import OpenAIHTTPBackend

            return OpenAIHTTPBackend(model_name, cfg, responses_api=cfg.responses_api)
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
