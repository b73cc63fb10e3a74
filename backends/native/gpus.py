"""GPU types the planner knows: datasheet memory, bandwidth and bf16 peak (no torch here: the CLI lists
them at start-up)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    bandwidth_gbs: float  # GB/s
    bf16_tflops: float  # dense, FP32 accumulate


# NVIDIA datasheets (SXM parts where there are several; GeForce and L40S: dense BF16 with FP32 accumulate).
GPUS = {
    "rtx3090": GPU("NVIDIA GeForce RTX 3090", 24, 936, 71),
    "rtx4090": GPU("NVIDIA GeForce RTX 4090", 24, 1008, 165.2),
    "a800-80g": GPU("NVIDIA A800 80GB SXM", 80, 2039, 312),
    "a100-40g": GPU("NVIDIA A100 40GB SXM", 40, 1555, 312),
    "a100-80g": GPU("NVIDIA A100 80GB SXM", 80, 2039, 312),
    "l40s": GPU("NVIDIA L40S", 48, 864, 362.05),
    "h100": GPU("NVIDIA H100 SXM", 80, 3350, 989.4),
    "h200": GPU("NVIDIA H200 SXM", 141, 4800, 989.4),
}
