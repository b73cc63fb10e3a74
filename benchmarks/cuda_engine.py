"""The native engine on a CUDA GPU, against the memory roofline and against transformers, in one run.

1. The device's copy bandwidth (a device-to-device copy, bytes read + written), the roofline below.
2. Decode at batch 1 of the design's 12.3B GQA model (configs/llama-12.3b-gqa.json, random weights,
   bf16; ``--layers`` shrinks it in depth to fit): step time with and without CUDA graphs, the bytes a
   step must read (every weight but the embedding table, plus the KV cache), achieved bandwidth as a
   share of the measured copy bandwidth, and time per layer.
3. SmolLM2 bf16, a burst of ``--requests`` (default 256) random-token prompts of ``--input-len`` (512)
   tokens, ``--output-len`` (128) tokens each (ignore_eos): output tok/s of the engine (its offline
   ``generate``: scheduler, sampler and detokenizer included) against transformers' ``generate`` on the
   same prompts as one static batch (its best), both after the same small warm-up burst, best of
   ``--rounds`` bursts of fresh prompts each; and the engine's decode step time at batch 1 / 64 / 256
   with and without CUDA graphs.

    python benchmarks/cuda_engine.py --out benchmarks/results/cuda_engine.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from backends.base import SamplingParams
from backends.native.batch import Batch
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine, start_engine
from backends.native.transfers import PendingPicks
from backends.native.weights import default_model_path


def cuda_time(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` timed with CUDA events (by the wall clock where there is no GPU: a rehearsal
    of a GPU script on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if not torch.cuda.is_available():
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(gib: float = 4.0, device: str = "cuda") -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), repeats=10)
    return 2 * src.numel() * src.element_size() / seconds


def decode_batch(engine: LLMEngine, contexts: list[int]) -> Batch:
    """A decode step for sequences with ``contexts`` tokens in fresh blocks (their keys: whatever the cache
    holds; a step's time does not depend on the values)."""
    bs, start, tables, slots = engine.blocks.block_size, 0, [], []
    for ctx in contexts:
        need = -(-ctx // bs)
        tables.append(list(range(start, start + need)))
        start += need
        slots.append(tables[-1][(ctx - 1) // bs] * bs + (ctx - 1) % bs)
    return Batch([7] * len(contexts), [c - 1 for c in contexts], slots, [1] * len(contexts), list(contexts),
                 tables, [True] * len(contexts))


def prefill_batch(engine: LLMEngine, n: int, length: int) -> Batch:
    """A step prefilling ``n`` fresh prompts of ``length`` tokens in blocks of their own."""
    bs, tables, next_block = engine.blocks.block_size, [], 0
    for _ in range(n):
        need = -(-length // bs)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
    ids = [7 + (i % 1000) for i in range(length)]
    return Batch(ids * n, list(range(length)) * n, [t[p // bs] * bs + p % bs for t in tables for p in range(length)],
                 [length] * n, [length] * n, tables, [True] * n)


def step_times(engine: LLMEngine, batch: Batch) -> dict[str, float]:
    """Decode step seconds with the engine's CUDA graphs and eagerly."""
    runner = engine.runner
    out = {"graphs_s": cuda_time(lambda: runner.execute(batch))}
    graphs, runner.graphs = runner.graphs, None
    out["eager_s"] = cuda_time(lambda: runner.execute(batch))
    runner.graphs = graphs
    return out


def design_model_decode(layers: int | None, context: int, bandwidth: float, tokenizer: str | None) -> dict:
    overrides = {"num_hidden_layers": layers} if layers else {}
    engine = start_engine(EngineConfig(model_path=str(ROOT / "configs/llama-12.3b-gqa.json"), load_format="dummy",
                                    hf_overrides=overrides, tokenizer=tokenizer, dtype="bfloat16", device="cuda", max_model_len=4096,
                                    max_num_seqs=8, kv_cache_gb=2.0, enable_prefix_caching=False))
    cfg = engine.model_config
    model = engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters(remove_duplicate=False)
                       if n != "embed_tokens.weight") + cfg.hidden_size * 2  # one embedding row is read
    kv_bytes = 2 * cfg.num_layers * context * cfg.num_kv_heads * cfg.head_dim * 2
    times = step_times(engine, decode_batch(engine, [context]))
    step = times["graphs_s"]
    result = {"layers": cfg.num_layers, "parameters": cfg.num_parameters(), "context": context,
              "bytes_per_step": weight_bytes + kv_bytes, **times, "per_layer_ms": step / cfg.num_layers * 1e3,
              "achieved_bytes_per_s": (weight_bytes + kv_bytes) / step,
              "roofline_fraction": (weight_bytes + kv_bytes) / step / bandwidth,
              "tokens_per_s": 1 / step}
    del engine, model
    torch.cuda.empty_cache()
    return result


def burst_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


def engine_burst(engine: LLMEngine, prompts: list[list[int]], output_len: int,
                 phases: dict[str, dict[str, float]] | None = None) -> float:
    """Output tok/s of one burst through ``engine.generate``; with ``phases``, the seconds spent in each part
    of the step loop are added to it, by kind of step (``decode``: decodes only, replayed from CUDA graphs;
    ``prefill``: steps with a prefill chunk). Synchronous steps wait for the GPU in ``execute`` (synchronised
    there, so that it holds the GPU's time); with async scheduling nothing is synchronised, the launches are
    host time and the wait for the GPU shows where a step's picks come back to the host (``tolist``), booked
    to the step launched just before."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    timed = _time_phases(engine, phases) if phases is not None else []
    _synchronize()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for owner, name, original in timed:
        if original is None:  # a method of the class: drop the instance's wrapper (no cycle keeps the engine)
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    assert all(len(o.token_ids) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


def _time_phases(engine: LLMEngine, phases: dict[str, dict[str, float]]) -> list:
    import backends.native.engine as engine_module

    kind = ["prefill"]  # of the step under way: set when it is scheduled

    def add(phase: str, seconds: float) -> None:
        totals = phases.setdefault(kind[0], {"steps": 0})
        totals[phase] = totals.get(phase, 0.0) + seconds

    def timer(name, fn, sync=False):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if sync:
                _synchronize()
            if name == "schedule" and out is not None:
                kind[0] = "decode" if out.batch.is_decode_only else "prefill"
                phases.setdefault(kind[0], {"steps": 0})["steps"] += 1
            add(name, time.perf_counter() - start)
            return out
        return run

    if engine.overlap_steps:
        targets = [(engine.scheduler, "schedule", False), (engine.runner, "execute", False),
                   (engine_module, "sample_tokens", False), (PendingPicks, "tolist", False),
                   (engine.scheduler, "resolve", False), (engine.scheduler, "advance", False)]
    else:
        targets = [(engine.scheduler, "schedule", False), (engine.runner, "execute", True),
                   (engine_module, "sample", False), (engine.scheduler, "postprocess", False)]
    saved = [(owner, name, vars(owner).get(name)) for owner, name, _ in targets]
    for owner, name, sync in targets:
        setattr(owner, name, timer(name, getattr(owner, name), sync))
    return saved


def kernel_profile(engine: LLMEngine, batch: Batch, rows: int = 15) -> list[dict]:
    """The GPU kernels of one eager step of ``batch``, by total time (torch.profiler): where a step's time
    goes, for the next kernel to write."""
    from torch.profiler import ProfilerActivity, profile

    runner, graphs = engine.runner, engine.runner.graphs
    runner.graphs = None
    try:
        runner.execute(batch)
        _synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.execute(batch)
            _synchronize()
    finally:
        runner.graphs = graphs
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:rows]
    return [{"kernel": e.key[:120], "calls": e.count, "us": e.device_time_total} for e in events]


def hf_burst(model, prompts: list[list[int]], output_len: int) -> float:
    ids = torch.tensor(prompts, device=model.device)
    _synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    _synchronize()
    elapsed = time.perf_counter() - start
    assert out.shape == (len(prompts), ids.shape[1] + output_len)
    return len(prompts) * output_len / elapsed


def smollm2(requests: int, input_len: int, output_len: int, seed: int, rounds: int,
            variants: dict[str, dict] | None = None, dummy: Path | None = None, device: str = "cuda") -> dict:
    """The burst through the engine in each of ``variants`` (name -> EngineConfig fields; default: with CUDA
    graphs as ``engine``, eager as ``engine_eager``) and through transformers' ``generate``; ``dummy``: random
    weights of this config.json's shape on both sides (SmolLM2's: the same speed, outputs are of fixed length)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    variants = variants or {"engine": {}, "engine_eager": {"enforce_eager": True}}
    source = dict(model_path=str(dummy), load_format="dummy") if dummy else {}
    result: dict = {"weights": f"random ({dummy.name}'s shape)" if dummy else "SmolLM2 GGUF"}
    for i, (name, overrides) in enumerate(variants.items()):
        engine = start_engine(EngineConfig(**{**source, "dtype": "bfloat16", "device": device,
                                           "max_model_len": input_len + output_len + 16, "max_num_seqs": requests,
                                           "max_num_batched_tokens": 8192, "enable_prefix_caching": False,
                                           **overrides}))
        engine_burst(engine, burst_prompts(16, input_len, seed + 100), 8)  # warm-up: compile the prefill shapes
        result[f"{name}_rounds_tok_s"] = [engine_burst(engine, burst_prompts(requests, input_len, seed + r), output_len)
                                          for r in range(rounds)]
        result[f"{name}_tok_s"] = max(result[f"{name}_rounds_tok_s"])
        phases: dict[str, dict[str, float]] = {}
        result[f"{name}_timed_tok_s"] = engine_burst(engine, burst_prompts(requests, input_len, seed + 7),
                                                     output_len, phases)
        result[f"{name}_step_phases_s"] = phases
        if i == 0 and engine.runner.graphs is not None:
            result["decode_step"] = {n: step_times(engine, decode_batch(engine, [input_len + output_len // 2] * n))
                                     for n in (1, 64, min(256, requests))}
            result["kernels"] = {
                "decode": kernel_profile(engine, decode_batch(engine, [input_len + output_len // 2] * requests)),
                "prefill": kernel_profile(engine, prefill_batch(engine, min(16, requests), input_len))}
        del engine
        gc.collect()  # its KV cache (most of the GPU) before the next engine sizes its own
        torch.cuda.empty_cache()
    path = default_model_path()
    if dummy:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(dummy)), dtype=torch.bfloat16).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.bfloat16).to(device).eval()
    hf_burst(model, burst_prompts(16, input_len, seed + 100), 8)  # warm-up
    result["transformers_rounds_tok_s"] = [hf_burst(model, burst_prompts(requests, input_len, seed + r), output_len)
                                           for r in range(rounds)]
    result["transformers_tok_s"] = max(result["transformers_rounds_tok_s"])
    first = next(iter(variants))
    result["engine_vs_transformers"] = result[f"{first}_tok_s"] / result["transformers_tok_s"]
    del model
    torch.cuda.empty_cache()
    return result


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rounds(values: list[float]) -> str:
    return " / ".join(f"{v:.0f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None, help="12.3B model depth (default: all 40)")
    parser.add_argument("--context", type=int, default=512, help="tokens in the KV cache at the measured decode")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="measured bursts per side (fresh prompts each); best")
    parser.add_argument("--tokenizer", default=None, help="for the 12.3B model (default: the embedded SmolLM2's)")
    parser.add_argument("--skip", choices=["design", "smollm2"], action="append", default=[])
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")

    results: dict = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                     "torch": torch.__version__, "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M")}
    results["copy_bytes_per_s"] = bandwidth = copy_bandwidth()
    print(f"{results['device']}: device-to-device copy {bandwidth / 1e12:.2f} TB/s (read + write)")
    if "design" not in args.skip:
        d = results["design_12b"] = design_model_decode(args.layers, args.context, bandwidth, args.tokenizer)
        print(f"12.3B GQA ({d['layers']} layers, {d['parameters'] / 1e9:.2f}B params) batch-1 decode at context "
              f"{d['context']}: {d['graphs_s'] * 1e3:.2f} ms/step with graphs ({d['eager_s'] * 1e3:.2f} eager), "
              f"{d['per_layer_ms']:.3f} ms/layer, {d['achieved_bytes_per_s'] / 1e12:.2f} TB/s = "
              f"{d['roofline_fraction']:.0%} of copy bandwidth, {d['tokens_per_s']:.1f} tok/s")
    if "smollm2" not in args.skip:
        s = results["smollm2_burst"] = smollm2(args.requests, args.input_len, args.output_len, args.seed, args.rounds)
        print(f"SmolLM2 bf16 burst {args.requests} x ({args.input_len} in, {args.output_len} out), best of "
              f"{args.rounds}: engine {s['engine_tok_s']:.0f} tok/s ({_rounds(s['engine_rounds_tok_s'])}; eager "
              f"{s['engine_eager_tok_s']:.0f}), transformers generate {s['transformers_tok_s']:.0f} tok/s "
              f"({_rounds(s['transformers_rounds_tok_s'])}) -> {s['engine_vs_transformers']:.1f}x")
        for kind, phases in s["engine_step_phases_s"].items():
            print(f"  {kind} steps of a timed burst ({s['engine_timed_tok_s']:.0f} tok/s), seconds: "
                  + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in phases.items()))
        for n, t in s["decode_step"].items():
            print(f"  decode step at batch {n}: {t['graphs_s'] * 1e3:.2f} ms with CUDA graphs, "
                  f"{t['eager_s'] * 1e3:.2f} ms eager ({t['eager_s'] / t['graphs_s']:.1f}x)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
