"""Native engine vs transformers, vLLM and DeepSpeed-Inference on one burst, same CPU, one run.
(llama.cpp, like every engine, through its HTTP server: ``served_burst.py --llamacpp``.)

Workload (issue #2): N requests, input lengths uniform in [32, 512], output lengths uniform in [16, 256],
ignore_eos, seeded, all sent at t=0. Peers:
  (a) transformers, one padded ``generate`` batch of all requests (static batching);
  (b) transformers, one request at a time (timed on a subset and scaled; the output says so);
  (c) vLLM's OpenAI server: ``--vllm`` starts the CPU build from .peers/vllm (``make peers``) for each
      dtype, or ``--vllm-url`` points at a server already serving the same model;
  (d) DeepSpeed-Inference (``init_inference``, no kernel injection), when deepspeed is installed.
Throughput is useful output tokens (each request's own length) per wall-clock second, prefill included.
The engine and vLLM run ``--repeats`` interleaved rounds (each round's prompts differ in their first
token, so no prefix cache carries over) and the best round counts: this shared machine is noisy.
Also printed: the engine's model FLOP/s (2 × parameters × tokens processed / s) against this machine's
matmul peak measured in the same run.

    python benchmarks/engine_vs_transformers.py --dtype float32 --dtype bfloat16 --vllm --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine, start_engine
from backends.native.weights import default_model_path


@dataclass
class Workload:
    prompts: list[list[int]]
    outputs: list[int]

    @property
    def useful_output_tokens(self) -> int:
        return sum(self.outputs)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def round(self, r: int) -> Workload:
        """The same lengths with a round-specific first token: no prefix cache hit across rounds."""
        return Workload([[3 + r] + p[1:] for p in self.prompts], self.outputs)


def make_workload(tokenizer, n: int, in_range: tuple[int, int], out_range: tuple[int, int], seed: int) -> Workload:
    rng = random.Random(seed)
    vocab = [i for i in range(tokenizer.vocab_size) if i not in (0, 1, 2)]  # no special tokens
    prompts = [[rng.choice(vocab) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*out_range) for _ in range(n)])


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of a large square matmul: this machine's practical peak for ``dtype``."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def native_engine(dtype: str, tokenizer) -> LLMEngine:
    engine = start_engine(EngineConfig(dtype=dtype, max_model_len=1024), tokenizer=tokenizer)
    engine.generate([list(range(100, 132))], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    return engine


def run_native(engine: LLMEngine, w: Workload) -> float:
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in w.outputs]
    start = time.perf_counter()
    outs = engine.generate(w.prompts, params)
    elapsed = time.perf_counter() - start
    assert [o.usage.completion_tokens for o in outs] == w.outputs
    return elapsed


def hf_model(dtype: torch.dtype):
    """transformers on plain (dequantised) weights: loading the GGUF directly keeps them packed and
    runs transformers' quantised kernels, which would make the baseline slower than it needs to be."""
    from peers import export_hf_dir
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(export_hf_dir()), dtype=dtype).eval()


@torch.inference_mode()
def run_hf_static(model, w: Workload, pad_id: int) -> float:
    longest = max(len(p) for p in w.prompts)
    ids = torch.full((len(w.prompts), longest), pad_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(w.prompts):  # left padding, as decoder-only batching needs
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    new = max(w.outputs)
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                   pad_token_id=pad_id)
    return time.perf_counter() - start


@torch.inference_mode()
def run_hf_sequential(model, w: Workload, pad_id: int, subset: int) -> tuple[float, int]:
    """Seconds for ``subset`` requests one at a time, and how many useful tokens they produced."""
    start, tokens = time.perf_counter(), 0
    for p, o in list(zip(w.prompts, w.outputs))[:subset]:
        model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                       max_new_tokens=o, min_new_tokens=o, do_sample=False, pad_token_id=pad_id)
        tokens += o
    return time.perf_counter() - start, tokens


def run_deepspeed(w: Workload, dtype: torch.dtype, pad_id: int) -> float | None:
    try:
        import deepspeed
    except ImportError:
        return None
    model = deepspeed.init_inference(hf_model(dtype), replace_with_kernel_inject=False, dtype=dtype)
    return run_hf_static(model.module, w, pad_id)


def run_openai_server(url: str, model: str, w: Workload, warm_up: bool = False) -> float:
    """Burst the workload's token-id prompts at an OpenAI-compatible server; each request must return exactly
    its output length (vLLM's ``ignore_eos``)."""
    import httpx

    async def burst() -> float:
        async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=None)) as client:
            async def one(p, o):
                r = await client.post(f"{url}/completions", json={"model": model, "prompt": p, "max_tokens": o,
                                                                  "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                assert r.json()["choices"][0]["finish_reason"] == "length", r.json()
            if warm_up:  # the first requests JIT kernels
                await asyncio.gather(*(one(list(range(100 + i, 132 + i)), 4) for i in range(8)))
            start = time.perf_counter()
            await asyncio.gather(*(one(p, o) for p, o in zip(w.prompts, w.outputs)))
            return time.perf_counter() - start

    return asyncio.run(burst())


@contextlib.contextmanager
def vllm_server(args, dtype: str):
    """(base URL, model name) of the vLLM server for ``dtype``: started here with --vllm, else --vllm-url."""
    if not args.vllm:
        yield (args.vllm_url, args.vllm_model) if args.vllm_url else None
        return
    from peers import PEERS, free_port, start_vllm

    port = free_port()
    proc = start_vllm(port, "smollm2", dtype, log=PEERS / f"vllm-{dtype}.log")
    try:
        yield f"http://127.0.0.1:{port}/v1", "smollm2"
    finally:
        proc.terminate()
        proc.wait(60)


def _rounds(seconds: list[float]) -> str:
    return ", ".join(f"{t:.1f}" for t in seconds) + " s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    ap.add_argument("--sequential-subset", type=int, default=4, help="requests timed one at a time, then scaled")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds of engine and vLLM; best counts")
    ap.add_argument("--vllm", action="store_true", help="start vLLM from .peers/vllm for each dtype (make peers)")
    ap.add_argument("--vllm-url", help="base URL (…/v1) of a vLLM server already serving the same model")
    ap.add_argument("--vllm-model", default="smollm2")
    ap.add_argument("--out", type=Path, default=Path("results/engine_vs_transformers.json"))
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    from backends.tokenizer import Tokenizer

    path = default_model_path()
    tokenizer = Tokenizer(path)
    w = make_workload(tokenizer, args.requests, tuple(args.input_len), tuple(args.output_len), args.seed)
    pad = tokenizer.hf.pad_token_id or 0
    print(f"workload: {args.requests} requests, {w.prompt_tokens} prompt tokens, {w.useful_output_tokens} output "
          f"tokens, burst at t=0; {torch.get_num_threads()} threads")
    results = {"workload": {"requests": args.requests, "prompt_tokens": w.prompt_tokens,
                            "output_tokens": w.useful_output_tokens}}
    for dtype_name in args.dtype or ["float32"]:
        dtype = getattr(torch, dtype_name)
        peak = matmul_peak(dtype)
        engine = native_engine(dtype_name, tokenizer)
        params = engine.model_config.num_parameters()
        native_s, vllm_s = [], []
        with vllm_server(args, dtype_name) as vllm:
            for r in range(args.repeats):
                native_s.append(run_native(engine, w.round(r)))
                if vllm:
                    vllm_s.append(run_openai_server(*vllm, w.round(r), warm_up=r == 0))
        del engine
        t_native = min(native_s)
        native_tps = w.useful_output_tokens / t_native
        flops = 2 * params * (w.prompt_tokens + w.useful_output_tokens) / t_native
        row = {"native_tok_s": native_tps, "native_s": native_s, "model_flops": flops, "matmul_peak_flops": peak,
               "mfu": flops / peak}
        print(f"\n[{dtype_name}] native engine: {native_tps:8.1f} output tok/s (best of {_rounds(native_s)})")
        print(f"[{dtype_name}] model FLOP/s {flops / 1e9:.1f} G = {flops / peak:.0%} of measured matmul peak "
              f"({peak / 1e9:.1f} GFLOP/s)")
        if vllm_s:
            vllm_tps = w.useful_output_tokens / min(vllm_s)
            row.update(vllm_tok_s=vllm_tps, vllm_s=vllm_s, ratio_vs_vllm=native_tps / vllm_tps)
            print(f"[{dtype_name}] vLLM ({dtype_name} server): {vllm_tps:8.1f} tok/s (best of {_rounds(vllm_s)}); "
                  f"native / vLLM = {native_tps / vllm_tps:.2f}x   (goal >= 1.0x)")
        if not args.skip_hf:
            model = hf_model(dtype)
            t_static = run_hf_static(model, w, pad)
            t_seq, seq_tokens = run_hf_sequential(model, w, pad, args.sequential_subset)
            static_tps, seq_tps = w.useful_output_tokens / t_static, seq_tokens / t_seq
            best = max(static_tps, seq_tps)
            row.update(hf_static_tok_s=static_tps, hf_sequential_tok_s=seq_tps, ratio_vs_best_hf=native_tps / best)
            print(f"[{dtype_name}] transformers static batch: {static_tps:8.1f} tok/s ({t_static:.1f} s)")
            print(f"[{dtype_name}] transformers one at a time: {seq_tps:8.1f} tok/s (timed on {args.sequential_subset} "
                  f"requests, {t_seq:.1f} s, scaled)")
            print(f"[{dtype_name}] native / best transformers = {native_tps / best:.2f}x   (goal >= 3x)")
            del model
            t_ds = run_deepspeed(w, dtype, pad)
            if t_ds is not None:
                ds_tps = w.useful_output_tokens / t_ds
                row.update(deepspeed_tok_s=ds_tps, ratio_vs_deepspeed=native_tps / ds_tps)
                print(f"[{dtype_name}] DeepSpeed-Inference static batch: {ds_tps:8.1f} tok/s; native / DS = "
                      f"{native_tps / ds_tps:.2f}x")
        results[dtype_name] = row
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
