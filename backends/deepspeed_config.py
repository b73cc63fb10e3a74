"""What a DeepSpeed-Inference deployment runs with (backends/deepspeed_inference.py). Apart from its backend so
that the gateway validates configs without loading torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DeepSpeedConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str | None = None  # local HF directory, .gguf or (dummy) config.json; None: the embedded SmolLM2
    load_format: Literal["auto", "dummy"] = "auto"  # dummy: random weights of the config's shape (vLLM's name)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights and activations
    max_batch_size: int = Field(32, ge=1)  # requests per static batch
