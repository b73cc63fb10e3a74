"""Decode steps replayed from CUDA graphs: one launch per step instead of hundreds.

A decode step of a small model is a few hundred short kernels; launched one by one from Python, the
GPU waits on the CPU between them. At start-up the whole forward pass is captured once per padded batch
size (1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs``) over static input buffers; a step copies
its tokens, positions and attention metadata into those buffers and replays the graph of the smallest
size that holds it. Padding rows write to the attention backend's scratch block and are never sampled.
Steps with prefill chunks, or more sequences than the largest graph, run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from backends.native.attention import AttentionBackend
from backends.native.batch import Batch
from backends.native.model import LlamaModel

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes with a graph: small powers of two, then every 16 (vLLM's spacing, coarser)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    """Captured decode steps of one model over one KV cache."""

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 attention: AttentionBackend, max_num_seqs: int, max_blocks: int) -> None:
        self.attention = attention
        self.sizes = capture_sizes(max_num_seqs)
        device = attention.device
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.meta = attention.static_decode_metadata(largest, max_blocks)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        started = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
                args = (self.input_ids[:size], self.positions[:size], kv_caches, self.meta.rows(size))
                model(*args)  # warm-up: kernels compiled and autotuned outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[size] = model(*args)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize(device)
        log.info("CUDA graphs: %d decode batch sizes up to %d captured in %.1f s", len(self.sizes), largest,
                 time.perf_counter() - started)

    def can_run(self, batch: Batch) -> bool:
        """A captured graph computes one decode token per sequence, samples every row and keeps only the
        logits that sample."""
        return (batch.is_decode_only and len(batch.token_ids) <= self.sizes[-1] and all(batch.sample)
                and not any(batch.all_logits))

    def run(self, batch: Batch, input_ids: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits [n, vocab] of a decode-only batch of ``n`` sequences, whose token ids on the device are
        ``input_ids`` (None on tensor-parallel ranks other than 0)."""
        n = len(batch.token_ids)
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(torch.tensor(batch.positions), non_blocking=True)
        self.attention.fill_decode_metadata(self.meta, batch, size)
        self.graphs[size].replay()
        logits = self.logits[size]
        return None if logits is None else logits[:n]
