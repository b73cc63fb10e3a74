"""Where one engine step's time goes, prefill and decode separately, against this machine's matmul peak.

Two steps of the native engine on the embedded SmolLM2 (its model runner, the kernels it picks here):
  prefill: ``--prompts`` fresh prompts of ``--prompt-len`` tokens in one step (default 4 x 512 = the
           default token budget of 2048);
  decode:  ``--batch`` sequences at context ``--context``, one new token each.
Each step is timed whole (median of ``--repeats``), then every part of it on the same shapes with the
model's own modules and kernels: the four linear projections over all layers (gate/up with its SiLU-and-mul,
which the tile kernel's rounding pass computes in bf16 on AMX, as it adds o_proj's and down_proj's products into
the residual stream, when the norms only normalise), attention (every layer's own queries and keys
from a real run of the step: its speed depends on the scores), the layer ops (RMSNorm +
residual, rotary + KV store), the LM head on the sampled rows; "rest" is the
step minus their sum (embedding, tensor building, Python; on a shared machine each part's median carries
its own noise, so a small negative rest means "nothing measurable"). A step that runs fused (fused_step.py:
every step of a bf16 model on AMX tiles, int8 weights included; up to 128 rows on fp32 strips) has its parts timed
layer by layer from Python all the same, so the parts' sum counts the Python that the fused step saves, and
its rest can be negative. Model FLOP/s counts 2 x parameters x tokens
(the LM head on its rows only) plus attention's 4 x heads x head_dim x keys per query; MFU divides it by
the fastest matmul of the engine's dtype measured in the same run: torch's square matmul and, for bf16 on AMX
tiles, the engine's own tile kernel on the same square and on the model's gate/up shape, where it is fastest
(a peak of torch's alone would flatter the engine, whose kernel beats it); ``mfu_vs_torch_matmul`` keeps the
ratio to torch's square matmul alone. Each part with FLOPs is also shown at the peak (its FLOPs / the peak), and
for the prefill step, the step time the MFU goal (75% in bf16, 80% in fp32) would take beside the time the parts
spend above the peak.
For the C attention kernel the script also times SDPA's causal kernel on the prefill's shape (keys and values
contiguous, so it gets no paged-cache gather).

    python benchmarks/step_profile.py --save benchmarks/results/step_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import run_record

from backends.native.batch import Batch
from backends.native.config import EngineConfig
from backends.native.linear_kernels import layout_serves_all_rows, tile_layout, tile_matmul
from backends.native.model_runner import ModelRunner
from backends.native.process import prepare_process
from backends.native.weights import default_model_path, open_checkpoint


def timings(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def each(fn: Callable[[object], object], items: list) -> None:
    """``fn`` on every item, each result dropped before the next call, as a step drops a layer's outputs (a list
    of 30 results alive at once would time fresh memory for every call)."""
    for item in items:
        fn(item)


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` after one untimed call."""
    return statistics.median(timings(fn, repeats))


def matmul_peak(dtype: torch.dtype, hidden: int, intermediate: int, size: int = 2048, repeats: int = 20
                ) -> dict[str, float]:
    """FLOP/s of the fastest of ``repeats`` matmuls of each kind: torch's square matmul and, for bf16 on AMX
    tiles, the engine's own tile kernel on the same square and on the model's widest projection (``size`` rows
    x ``hidden`` -> 2 x ``intermediate``, where it is fastest). The fastest of them is this machine's practical
    peak for ``dtype`` (the fastest, not the mean: on a shared machine the mean measures the neighbours too).
    ``main`` takes the faster of a measure before and one after the steps: a slow spell during one would
    inflate MFU."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    calls = {"torch.mm": (lambda: torch.mm(a, b), 2 * size**3)}
    if layout_serves_all_rows(b, dtype):
        square = tile_layout(b.t().contiguous())
        x, w = torch.randn(size, hidden, dtype=dtype), torch.randn(2 * intermediate, hidden, dtype=dtype)
        wide = tile_layout(w)
        calls["tile kernel, square"] = (lambda: tile_matmul(a, square), 2 * size**3)
        calls["tile kernel, gate/up shape"] = (lambda: tile_matmul(x, wide), 2 * size * hidden * 2 * intermediate)
    return {name: flops / min(timed(call, 1) for _ in range(repeats)) for name, (call, flops) in calls.items()}


def make_batch(runner: ModelRunner, query_lens: list[int], context_lens: list[int]) -> Batch:
    """Sequences on consecutive blocks, each computing its last ``query_lens[i]`` of ``context_lens[i]`` positions."""
    bs, tables, next_block = runner.block_size, [], 0
    token_ids, positions, slots = [], [], []
    for n, ctx in zip(query_lens, context_lens):
        table = list(range(next_block, next_block + -(-ctx // bs)))
        next_block += len(table)
        tables.append(table)
        for p in range(ctx - n, ctx):
            token_ids.append(100 + p % 30000)
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
    if next_block > runner.num_blocks:
        raise ValueError(f"the step needs {next_block} KV blocks; the cache has {runner.num_blocks}")
    decode_first = sorted(range(len(query_lens)), key=lambda i: query_lens[i] != 1)
    assert decode_first == list(range(len(query_lens))), "decodes must come first"
    return Batch(token_ids, positions, slots, query_lens, context_lens, tables, [True] * len(query_lens))


def real_attention_inputs(runner: ModelRunner, batch: Batch, meta) -> list[tuple]:
    """Every layer's (q, k, v, k_cache, v_cache) of the step, from its input in a real run: attention's speed
    depends on its scores (the tile kernel raises a row's running maximum only where the scores call for it),
    so random queries against the model's keys would time another kernel run than the step's."""
    inputs: list[torch.Tensor] = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda _, args: inputs.append(args[0].clone()))
             for layer in runner.model.layers]
    try:  # the model's own forward: a fused step (fused_step.py) would not call the layers
        runner.model(torch.tensor(batch.token_ids), torch.tensor(batch.positions), runner.kv_caches, meta)
    finally:
        for hook in hooks:
            hook.remove()
    rope = runner.model.rotary.tables(torch.tensor(batch.positions))
    out = []
    for layer, x, kv in zip(runner.model.layers, inputs, runner.kv_caches):
        attn = layer.self_attn
        q, k, v = attn.ops.rotary_store_kv(attn.qkv_proj(x), attn.num_heads, attn.num_kv_heads, *rope, *kv,
                                           meta.slot_mapping)
        out.append((q, k, v, *kv))
    return out


@torch.inference_mode()
def profile_step(runner: ModelRunner, batch: Batch, repeats: int) -> dict:
    """The whole step's seconds, each part's seconds (all layers) and FLOPs, and the step's model FLOPs."""
    model, cfg = runner.model, runner.model.config
    meta = runner.kernels.attention.build(batch)
    step = timed(lambda: runner.execute(batch), repeats)
    tokens, layers, attn = len(batch.token_ids), model.layers, model.layers[0].self_attn
    attention_inputs = real_attention_inputs(runner, batch, meta)
    x = torch.randn(tokens, cfg.hidden_size, dtype=runner.dtype)
    qkv = attn.qkv_proj(x)
    rope = model.rotary.tables(torch.tensor(batch.positions))
    act = layers[0].mlp.gate_up_proj.silu_and_mul(x, layers[0].mlp.ops)
    rows, h, residual, stream = x[meta.logits_indices], x.clone(), x.clone(), x.clone()
    keys = sum(n * ctx - n * (n - 1) / 2 for n, ctx in zip(batch.query_lens, batch.context_lens))  # causal
    inputs = {("self_attn", "qkv_proj"): x, ("self_attn", "o_proj"): torch.randn(tokens, attn.q_size, dtype=runner.dtype),
              ("mlp", "gate_up_proj"): x, ("mlp", "down_proj"): act}

    def projection(owner: str, name: str) -> tuple[Callable[[], object], float]:
        """Every layer's ``owner.name`` on its input, as the model calls it, and the FLOPs of that."""
        modules = [getattr(getattr(layer, owner), name) for layer in layers]
        weights = modules[0].in_features * modules[0].out_features
        x, ops = inputs[owner, name], layers[0].mlp.ops
        call = {"gate_up_proj": lambda m: m.silu_and_mul(x, ops), "qkv_proj": lambda m: m(x)}.get(
            name, lambda m: m.with_residual(x, stream))  # o_proj and down_proj join the residual stream
        return (lambda: each(call, modules)), 2 * tokens * weights * len(layers)

    # where o_proj and down_proj add into the residual stream themselves, the norms only normalise
    norms_add = attn.o_proj.with_residual(inputs["self_attn", "o_proj"], stream.clone())[1] is not None

    parts = {
        **{"gate_up_proj + silu" if name == "gate_up_proj" else name: projection(owner, name)
           for owner, name in inputs},
        # before rotary_store_kv below, which writes random keys into the caches
        "attention": (lambda: each(lambda a: attn.backend.forward(*a, meta, attn.scale), attention_inputs),
                      4 * attn.num_heads * attn.head_dim * keys * len(layers)),
        # in place, as in the step: the rows are normalised again and rotated again on each call
        "add_rms_norm x2" if norms_add else "rms_norm x2": (
            lambda: [layer.input_layernorm(h, residual if norms_add else None) for layer in layers for _ in (0, 1)], 0),
        "rotary_store_kv": (lambda: each(lambda kv: attn.ops.rotary_store_kv(qkv, attn.num_heads, attn.num_kv_heads,
                                                                              *rope, *kv, meta.slot_mapping),
                                         runner.kv_caches), 0),
        "lm_head": (lambda: model.lm_head(rows), 2 * len(rows) * cfg.hidden_size * model.lm_head.out_features),
    }
    out = {"tokens": tokens, "sequences": len(batch.query_lens), "step_s": step, "parts": {}}
    for name, (fn, flops) in parts.items():
        seconds = timed(fn, repeats)
        out["parts"][name] = {"s": seconds, "share": seconds / step, "gflop": flops / 1e9,
                              "gflop_s": flops / seconds / 1e9 if flops else None}
    out["parts"]["rest"] = {"s": step - sum(p["s"] for p in out["parts"].values()), "gflop": 0.0, "gflop_s": None}
    out["parts"]["rest"]["share"] = out["parts"]["rest"]["s"] / step
    out["model_flops"] = sum(flops for _, flops in parts.values())
    out["model_gflop_s"] = out["model_flops"] / step / 1e9
    return out


def against_peak(result: dict, peak: float, torch_peak: float, goal: float | None) -> None:
    """Add to a profile_step result its MFU against ``peak`` (and against torch's matmul alone, the issue's first
    definition), each part's seconds at the peak, and with a ``goal`` (prefill: a decode step is bound by memory,
    not by the matmul peak) the step time that MFU would take."""
    result["mfu"] = result["model_gflop_s"] * 1e9 / peak
    result["mfu_vs_torch_matmul"] = result["model_gflop_s"] * 1e9 / torch_peak
    for part in result["parts"].values():
        part["s_at_peak"] = part["gflop"] * 1e9 / peak
    if goal is not None:
        result["mfu_goal"] = goal
        result["step_s_at_mfu_goal"] = result["model_flops"] / (goal * peak)


def sdpa_prefill(prompts: int, prompt_len: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 repeats: int) -> float:
    """Seconds of torch's causal SDPA for one layer on the prefill's shape (GQA by repeated keys)."""
    q = torch.randn(prompts, heads, prompt_len, head_dim, dtype=dtype)
    k = torch.randn(prompts, kv_heads, prompt_len, head_dim, dtype=dtype).repeat_interleave(heads // kv_heads, 1)
    v = torch.randn_like(k)
    return timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the engine's dtype (auto: bf16 where the CPU multiplies it natively, as `burstgate serve`)")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    config = EngineConfig(dtype=args.dtype, max_model_len=max(args.prompt_len, args.context) + 1)
    prepare_process(config)
    runner = ModelRunner(config, open_checkpoint(default_model_path()), config.max_model_len)
    cfg = runner.model.config
    peak_args = (runner.dtype, cfg.hidden_size, cfg.intermediate_size)
    peaks = matmul_peak(*peak_args)
    steps = {
        "prefill": make_batch(runner, [args.prompt_len] * args.prompts, [args.prompt_len] * args.prompts),
        "decode": make_batch(runner, [1] * args.batch, [args.context] * args.batch),
    }
    results = {name: profile_step(runner, batch, args.repeats) for name, batch in steps.items()}
    peaks = {name: max(rate, peaks[name]) for name, rate in matmul_peak(*peak_args).items()}
    peak = max(peaks.values())
    goal = 0.80 if runner.dtype == torch.float32 else 0.75  # the MFU goals: fp32 80%, bf16 75%
    for name, r in results.items():
        against_peak(r, peak, peaks["torch.mm"], goal if name == "prefill" else None)
        print(f"\n{name}: {r['sequences']} sequences, {r['tokens']} tokens, step {r['step_s'] * 1000:.1f} ms, "
              f"{r['tokens'] / r['step_s']:.0f} tok/s, model {r['model_gflop_s']:.1f} GFLOP/s = {r['mfu']:.0%} "
              f"of the matmul peak ({peak / 1e9:.1f} GFLOP/s, {runner.dtype}; "
              + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in peaks.items()) + ")")
        for part, p in r["parts"].items():
            rate = f"{p['gflop_s']:7.1f} GFLOP/s, {p['s_at_peak'] * 1000:5.1f} ms at the peak" if p["gflop"] else ""
            print(f"  {part:20s} {p['s'] * 1000:8.1f} ms  {p['share']:6.1%}  {rate}")
        if "mfu_goal" in r:
            over_peak = sum(p["s"] - p["s_at_peak"] for p in r["parts"].values() if p["gflop"])
            no_flops = sum(p["s"] for p in r["parts"].values() if not p["gflop"])
            print(f"  MFU {r['mfu_goal']:.0%} needs a step of {r['step_s_at_mfu_goal'] * 1000:.1f} ms; the parts with "
                  f"FLOPs take {over_peak * 1000:.1f} ms more than at the peak, the others (and the rest) "
                  f"{no_flops * 1000:.1f} ms")
    attn = runner.model.layers[0].self_attn
    sdpa = sdpa_prefill(args.prompts, args.prompt_len, attn.num_heads, attn.num_kv_heads, attn.head_dim, runner.dtype,
                        args.repeats)
    c_attention = results["prefill"]["parts"]["attention"]["s"] / len(runner.model.layers)
    print(f"\nprefill attention per layer: C paged kernel {c_attention * 1000:.1f} ms, torch SDPA causal "
          f"{sdpa * 1000:.1f} ms ({sdpa / c_attention:.2f}x the kernel's time)")
    if args.save:
        args.save.write_text(json.dumps({**run_record(), "matmul_peak_gflop_s": peak / 1e9,
                                         "matmul_peaks_gflop_s": {k: v / 1e9 for k, v in peaks.items()},
                                         "dtype": str(runner.dtype),
                                         "kernels": {"attention": runner.kernels.attention.name},
                                         "sdpa_prefill_attention_per_layer_s": sdpa,
                                         "c_prefill_attention_per_layer_s": c_attention, **results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
