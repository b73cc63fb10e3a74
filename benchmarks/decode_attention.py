"""Decode attention alone: the C paged kernel against the pure-torch path.

One decode step's attention over every layer of the embedded SmolLM2's layout (9 query heads, 3 KV heads,
head size 64): ``--batch`` sequences at context ``--context``, their blocks of ``--block-size`` tokens scattered
over each layer's cache (a fresh cache per layer, so nothing stays in the CPU's caches between layers), through
each attention backend's own ``build`` and ``forward``. The default, 16-token blocks, is the hardest case for
the memory (the CPU engine's blocks hold 64 unless asked otherwise; the files of earlier runs took 16). Caches
in bf16, in fp8 (e4m3 with bf16 queries, what ``kv_cache_dtype: fp8`` stores) and in fp32. Printed per cache:
milliseconds for all layers (fastest of ``--repeats``), the KV bytes read per second, and the C kernel's speed-up
over the torch path (which gathers each sequence's blocks into a contiguous copy before its matmuls).

    python benchmarks/decode_attention.py --save benchmarks/results/decode_attention_amx.json
    python benchmarks/decode_attention.py --block-size 16 --save benchmarks/results/decode_attention_block16_amx.json
    python benchmarks/decode_attention.py --block-size 64 --save benchmarks/results/decode_attention_block64_amx.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import run_record
from step_profile import timings

from backends.native.attention.cpu_attention import CpuAttention
from backends.native.attention.torch_attention import TorchAttention
from backends.native.batch import Batch

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
CACHES = ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.float32))


def decode_batch(batch: int, context: int, num_blocks: int, block_size: int) -> Batch:
    """``batch`` decodes at ``context``, their blocks a random permutation of the cache's."""
    per_seq = -(-context // block_size)
    blocks = torch.randperm(num_blocks)[:batch * per_seq].view(batch, per_seq).tolist()
    slots = [table[(context - 1) // block_size] * block_size + (context - 1) % block_size for table in blocks]
    return Batch([0] * batch, [context - 1] * batch, slots, [1] * batch, [context] * batch, blocks, [True] * batch)


def step_attention(backend, meta, q, k, v, caches):
    """One step's attention, every layer's cache in turn."""
    return lambda: [backend.forward(q, k, v, kc, vc, meta, HEAD_DIM ** -0.5) for kc, vc in caches]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    bs = args.block_size
    num_blocks = args.batch * -(-args.context // bs)
    batch = decode_batch(args.batch, args.context, num_blocks, bs)
    rows = []
    for dtype, cache_dtype in CACHES:
        caches = [tuple(torch.randn(KV_HEADS, num_blocks, bs, HEAD_DIM).to(cache_dtype) for _ in range(2))
                  for _ in range(args.layers)]
        q = torch.randn(args.batch, HEADS, HEAD_DIM).to(dtype)
        k = v = torch.randn(args.batch, KV_HEADS, HEAD_DIM).to(dtype)  # stored already: not read by forward
        kv_bytes = sum(c.numel() * c.element_size() for pair in caches for c in pair)
        row = {"dtype": str(dtype), "kv_cache_dtype": str(cache_dtype), "kv_bytes": kv_bytes}
        for name, backend in (("c", CpuAttention(bs, num_blocks, torch.device("cpu"))),
                              ("torch", TorchAttention(bs, num_blocks, torch.device("cpu")))):
            seconds = min(timings(step_attention(backend, backend.build(batch), q, k, v, caches), args.repeats))
            row[f"{name}_s"] = seconds
            print(f"{cache_dtype!s:19s} {name:6s} {seconds * 1000:8.1f} ms for {args.layers} layers, "
                  f"{kv_bytes / seconds / 1e9:5.1f} GB/s of KV")
        row["c_speedup"] = row["torch_s"] / row["c_s"]
        print(f"{cache_dtype!s:19s} C kernel {row['c_speedup']:.2f}x the torch path")
        rows.append(row)
    if args.save:
        args.save.write_text(json.dumps({**run_record(), "batch": args.batch, "context": args.context,
                                         "layers": args.layers, "block_size": bs, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
