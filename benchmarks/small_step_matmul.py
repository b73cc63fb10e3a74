"""Small steps' linear layers in bf16: the tile copy (csrc/tile_linear.c) against oneDNN's packed weights.

A decode step multiplies every linear weight of the model by one row per running sequence. Up to ``TILE_ROWS``
rows the engine reads a bf16 weight's tile copy where this CPU has a kernel for it (AMX tiles, or AVX512-BF16
vectors), else oneDNN's packed copy. This times both on SmolLM2's 30 decoder layers (q/k/v, o, gate/up with
SwiGLU, down: 30 distinct weights of each, ~212 MB in bf16, so a pass reads them from memory as a step does)
through the engine's own modules (``Linear``, ``GateUpLinear.silu_and_mul`` with the C layer ops), at each row
count, the two paths interleaved, best of ``--repeats`` passes each after one untimed pass. ``--int8`` adds the
weight-only int8 layers: their tile copy against csrc/int8_linear.c (up to ``INT8_KERNEL_ROWS`` rows) or the
dequantising path beyond. Prints ms per pass and the ratio oneDNN / tiles (above 1: the tiles are faster).

    python benchmarks/small_step_matmul.py --int8 --save benchmarks/results/small_step_matmul_epyc.json
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

from backends.native.layer_ops import CpuLayerOps
from backends.native.linear import GateUpLinear, Int8Rows, Linear
from backends.native.linear_kernels import TILE_ROWS, can_tile

HIDDEN, INTERMEDIATE, QKV, LAYERS = 576, 1536, 960, 30  # SmolLM2-135M


def layers(int8: bool, tiles: bool) -> list[tuple[Linear, Linear, GateUpLinear, Linear]]:
    """30 layers of random weights laid out as the engine lays them out: a tile copy for small steps (``tiles``)
    beside oneDNN's packing (bf16) or the int8 rows."""
    built = []
    for _ in range(LAYERS):
        mods = (Linear(HIDDEN, QKV, bias=False), Linear(HIDDEN, HIDDEN, bias=False),
                GateUpLinear(HIDDEN, 2 * INTERMEDIATE, bias=False), Linear(INTERMEDIATE, HIDDEN, bias=False))
        for m in mods:
            weight = m.weight.detach().bfloat16()
            if int8:
                q = Int8Rows.quantize(weight)
                m.to_int8()
                m.weight.data.copy_(q.values)
                m.scales.data.copy_(q.scales)
            else:
                m.weight = torch.nn.Parameter(weight, requires_grad=False)
            m.pack("tiles" if tiles else None)  # int8: the int8 kernel, after the tiles where asked
        built.append(mods)
    return built


def one_pass(model: list, rows: int) -> None:
    """Every layer's four projections on ``rows`` rows, as a step runs them (outputs dropped as it goes)."""
    x, attn, act = (torch.randn(rows, n).bfloat16() for n in (HIDDEN, HIDDEN, INTERMEDIATE))
    for qkv, o, gate_up, down in model:
        qkv(x), o(attn), gate_up.silu_and_mul(x, CpuLayerOps), down(act)


def best_ms(model: list, rows: int, repeats: int) -> float:
    """The fastest of ``repeats`` passes, after an untimed one."""
    return min(timings(lambda: one_pass(model, rows), repeats)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24, 32, 48, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="the paths interleaved this many times per row count")
    ap.add_argument("--int8", action="store_true", help="also the weight-only int8 layers")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    if max(args.rows) > TILE_ROWS:
        ap.error(f"the tile copy serves steps of up to {TILE_ROWS} rows")
    if not can_tile(torch.zeros(16, 32, dtype=torch.bfloat16)):
        sys.exit("this CPU has no tile kernel (AMX tiles or AVX512-BF16), or no C kernels")
    torch.manual_seed(0)
    kinds = {"bf16": (layers(False, True), layers(False, False), "oneDNN")}
    if args.int8:
        kinds["int8"] = (layers(True, True), layers(True, False), "int8 rows")
    results = []
    for kind, (tiled, other, other_name) in kinds.items():
        for rows in args.rows:
            tile_ms, other_ms = [], []
            for _ in range(args.rounds):
                tile_ms.append(best_ms(tiled, rows, args.repeats))
                other_ms.append(best_ms(other, rows, args.repeats))
            row = {"weights": kind, "rows": rows, "tiles_ms": min(tile_ms), f"{other_name}_ms": min(other_ms),
                   "speedup": min(other_ms) / min(tile_ms)}
            results.append(row)
            print(f"{kind:5} {rows:3} rows: tiles {row['tiles_ms']:7.2f} ms, {other_name} {min(other_ms):7.2f} ms,"
                  f" {other_name} / tiles {row['speedup']:.2f}x", flush=True)
    if args.save:
        args.save.write_text(json.dumps({**run_record(), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
