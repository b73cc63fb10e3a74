"""The int8 weight matmul against fp32 on SmolLM2's shapes, one process, one CPU.

For each shape (q/k/v + gate/up fused rows are cut to the model's layer shapes: 576 -> 1536, 1536 -> 576,
and the LM head 576 -> 49152) and each number of rows (sequences in a decode step): fp32 with the weight
prepacked for oneDNN (the engine's float path), torch's ``_weight_int8pack_mm`` (gpt-fast's int8 kernel),
burstgate's C kernel (csrc/int8_linear.c) and the dequantise-then-GEMM path that ``int8_matmul`` takes above
``INT8_KERNEL_ROWS``. Times are the best of 3 runs of 20 calls each, after one warm-up call.

    python benchmarks/int8_matmul.py --save benchmarks/results/int8_matmul.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import run_record

from backends.native.linear import Int8Rows
from backends.native.linear_kernels import INT8_KERNEL_ROWS, int8_matmul

SHAPES = {"mlp_up (576->1536)": (576, 1536), "mlp_down (1536->576)": (1536, 576), "lm_head (576->49152)": (576, 49152)}


def best_ms(fn, calls: int = 20, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    out = []
    for name, (k, n) in SHAPES.items():
        weight = torch.randn(n, k)
        q = Int8Rows.quantize(weight)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        for rows in args.rows:
            x = torch.randn(rows, k)
            row = {"shape": name, "rows": rows,
                   "fp32_onednn_ms": best_ms(lambda x=x, packed=packed: torch.ops.mkldnn._linear_pointwise(
                       x, packed, None, "none", [], "")),
                   "torch_int8pack_ms": best_ms(lambda x=x, q=q: torch.ops.aten._weight_int8pack_mm(
                       x, q.values, q.scales), 5, 1),
                   "int8_matmul_ms": best_ms(lambda x=x, q=q: int8_matmul(x, q.values, q.scales)),
                   "int8_path": "C kernel" if rows <= INT8_KERNEL_ROWS else "dequantised GEMM"}
            row["int8_over_fp32_speed"] = row["fp32_onednn_ms"] / row["int8_matmul_ms"]
            out.append(row)
            print(f"{name:22s} rows {rows:3d}: fp32 {row['fp32_onednn_ms']:7.3f} ms  torch int8 "
                  f"{row['torch_int8pack_ms']:8.3f} ms  ours ({row['int8_path']}) {row['int8_matmul_ms']:7.3f} ms "
                  f"= {row['int8_over_fp32_speed']:.2f}x fp32", flush=True)
    if args.save:
        args.save.write_text(json.dumps({**run_record(), "rows": out}, indent=2) + "\n")


if __name__ == "__main__":
    main()
