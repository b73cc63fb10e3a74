"""How long a server takes from its start to its first answer: what a rolling restart, a crashed replica's
replacement or a scale-out waits for before the new process takes traffic.

Targets: ``burstgate serve`` (the embedded default, the CPU defaults), vLLM's CPU build on the same model
(``--vllm``; make peers) and ``burstgate serve`` of an earlier commit of this repository (``--baseline REV``:
checked out in a temporary worktree, run by this environment's Python). Each start is timed from the process's
spawn to the first 200 of ``/v1/models`` (both servers answer it once their engine is up), then to the end of a
first completion (one token), the port polled every 20 ms; the server is stopped before the next one starts. Rounds are
interleaved, the targets' order alternating. Caches are warm (this machine's CPU kernels built, the GGUF's
tokenizer converted, vLLM's model exported): a restart, not a first install. Medians over rounds; ratios
against burstgate at this checkout.

    python benchmarks/startup.py --rounds 5 --vllm --baseline 5f7fe61 --save benchmarks/results/startup.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import ROOT, export_hf_dir, free_port, positive_int, run_record, start_vllm, wait_ready

MODEL = "smollm2"
POLL_S = 0.02


def timed_start(spawn, port: int, timeout_s: float = 600.0) -> dict:
    """Seconds from ``spawn(port)`` (which returns the process) to the first 200 of ``/v1/models``, and to the end
    of a first one-token completion; the process is stopped afterwards."""
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    proc = spawn(port)
    try:
        wait_ready(url, timeout_s, proc, poll_s=POLL_S)
        ready = time.perf_counter() - started
        body = {"model": MODEL, "prompt": "The sea is", "max_tokens": 1, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        return {"ready_s": ready, "first_answer_s": time.perf_counter() - started}
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def burstgate_spawner(checkout: Path):
    """``burstgate serve`` of the code in ``checkout`` (``-m`` run there imports the checkout's own packages;
    this environment's dependencies), serving MODEL."""
    def spawn(port: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--served-model-name", MODEL,
               "--log-level", "warning"]
        return subprocess.Popen(cmd, cwd=checkout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return spawn


def vllm_spawner(port: int) -> subprocess.Popen:
    return start_vllm(port, MODEL, wait=False)


@contextlib.contextmanager
def worktree(rev: str):
    """A detached checkout of ``rev`` of this repository, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="burstgate-baseline-") as scratch:
        path = Path(scratch) / "checkout"
        added = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev],
                               capture_output=True, text=True)
        if added.returncode != 0:
            raise SystemExit(f"--baseline {rev}: {added.stderr.strip()}")
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--vllm", action="store_true", help="vLLM's CPU build too (make peers)")
    ap.add_argument("--baseline", metavar="REV", help="burstgate serve at this commit too")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        targets = {"burstgate": burstgate_spawner(ROOT)}
        if args.baseline:
            targets[f"burstgate@{args.baseline}"] = burstgate_spawner(stack.enter_context(worktree(args.baseline)))
        if args.vllm:
            export_hf_dir()  # the model as vLLM loads it, exported once before any start is timed
            targets["vllm"] = vllm_spawner
        times: dict[str, list[dict]] = {name: [] for name in targets}
        for r in range(args.rounds):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for name in order:
                times[name].append(timed_start(targets[name], free_port()))
                print(f"round {r} {name:24s} ready {times[name][-1]['ready_s']:6.2f} s, first answer "
                      f"{times[name][-1]['first_answer_s']:6.2f} s", flush=True)
    medians = {name: {k: statistics.median(t[k] for t in runs) for k in ("ready_s", "first_answer_s")}
               for name, runs in times.items()}
    ratios = {name: {k: m[k] / medians["burstgate"][k] for k in m} for name, m in medians.items()}
    for name in targets:
        print(f"{name:24s} ready {medians[name]['ready_s']:6.2f} s ({ratios[name]['ready_s']:.2f}x), first answer "
              f"{medians[name]['first_answer_s']:6.2f} s ({ratios[name]['first_answer_s']:.2f}x)")
    if args.save:
        record = {**run_record(), "rounds": times, "medians": medians, "ratios_to_burstgate": ratios}
        args.save.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
