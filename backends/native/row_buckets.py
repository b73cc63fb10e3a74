"""Steps padded to a few row counts, so that oneDNN builds each matmul once, at start-up.

oneDNN compiles a kernel for every new shape of a matmul on packed weights and keeps the last 1,024
(its primitive cache). A step's row count is its token count, which a burst varies from 1 to the token
budget: bursts paid for hundreds of compilations, each several times a warm call, and a long-lived server with varied
traffic kept evicting and recompiling. Padded to these buckets (a handful of rows more per step: the padding
rows write their keys and values to the attention backend's scratch block and are never sampled), the
shapes are few enough to compile every one of them in ``warm_up_linears`` before serving.
"""

from __future__ import annotations

import logging
import time

import torch

from backends.native.layer_ops import TorchLayerOps
from backends.native.linear import GateUpLinear, Linear

log = logging.getLogger(__name__)


def padded_rows(n: int) -> int:
    """The bucket that holds ``n`` rows: powers of two up to 8, then every 8 to 64, every 16 to 256 and
    every 64 beyond (at most 15 rows of padding in a decode step of up to 256 sequences, 3% at 2,048)."""
    if n <= 8:
        return 1 << (max(n, 1) - 1).bit_length()
    step = 8 if n <= 64 else 16 if n <= 256 else 64
    return -(-n // step) * step


def buckets(max_rows: int) -> list[int]:
    """Every bucket a step of up to ``max_rows`` rows can be padded to, smallest first."""
    sizes, n = [], 1
    while n <= max_rows:
        sizes.append(n)
        n = padded_rows(n + 1)
    return sizes if sizes[-1] >= max_rows else [*sizes, padded_rows(max_rows)]


@torch.inference_mode()
def warm_up_linears(model: torch.nn.Module, dtype: torch.dtype, max_rows: int, max_head_rows: int) -> None:
    """Run every distinct linear layer of ``model`` whose kernel compiles per shape (oneDNN's) once at every bucket
    (up to ``max_head_rows`` for the LM head, ``max_rows`` for the others), on ``dtype`` activations, so that none
    is compiled while serving."""
    started = time.perf_counter()
    shapes: dict[tuple, Linear] = {}
    head = getattr(model, "lm_head", None)
    for module in model.modules():
        if isinstance(module, Linear) and module.kernel.compiles_per_shape:
            shapes.setdefault((module is head, type(module), module.in_features, module.out_features), module)
    calls = 0
    for (is_head, kind, in_features, _), module in shapes.items():
        for rows in buckets(max_head_rows if is_head else max_rows):
            x = torch.zeros(rows, in_features, dtype=dtype)
            module.silu_and_mul(x, TorchLayerOps) if kind is GateUpLinear else module(x)  # as the model calls it
            calls += 1
    log.info("native engine: %d matmul shapes compiled in %.2f s", calls, time.perf_counter() - started)
