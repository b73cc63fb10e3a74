"""The load tester against guidellm, side by side in one run.

1. Capacity: against the instant mock server, the highest constant request rate each tool sustains
   with p99 send lag (actual − targeted send time) ≤ 2 ms and ≥ 98% of the rate achieved. For
   guidellm the lag is read from its per-request timings (``request_start − targeted_start``).
2. Agreement: both tools measure the same burstgate gateway (in front of a mock engine with fixed
   delays, then serving SmolLM2 on this CPU) on the same workload (a burst of chat requests, fixed
   prompt and output lengths, ignore_eos); their output token throughput and median TTFT are compared.

    make peers-guidellm     # guidellm 0.8.1 in .peers/guidellm (CPU torch first)
    python benchmarks/loadtest_capacity.py --rates 100,200,400,800,1600,3200 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import GUIDELLM, HF_DIR, export_hf_dir, free_port, wait_ready

from loadtest.client import RequestOptions, Target
from loadtest.runner import RunConfig, run_target
from loadtest.schedule import Schedule
from loadtest.workload import RequestSpec, load_tokenizer, synthetic

LAG_LIMIT_MS = 2.0
# guidellm's best settings here: its default worker count for capacity (400 req/s achieved against 200
# with one worker); one worker for agreement (its default spawns up to 10 that fight the server for 2 cores).
AGREEMENT_GUIDELLM_WORKERS = 1
MIN_ACHIEVED = 0.98
BURSTGATE = Path(sys.executable).parent / "burstgate"


def ours_at(url: str, rate: float, seconds: float, workers: int, output_len: int) -> tuple[float, float]:
    """(p99 send lag ms, achieved req/s) of our tester at a constant ``rate``."""
    specs = [RequestSpec("hello world", 2, output_len)] * int(rate * seconds)
    s = asyncio.run(run_target(Target(url, "mock"), specs, RunConfig(schedule=Schedule.constant, rate=rate,
                                                                     workers=workers))).summary
    return s["p99_send_lag_ms"], s["request_throughput"] if s["failed"] == 0 else 0.0


def guidellm(url: str, model: str, profile: str, count: int, prompt_tokens: int, output_tokens: int,
             workers: int | None = None) -> dict:
    """One guidellm run with ``workers`` worker processes (None: its default, up to 10); returns its JSON
    report's first benchmark."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [str(GUIDELLM), "run", "--backend", f"kind=openai_http,target={url},model={model}",
               "--profile", profile, "--constraint", f"kind=max_requests,count={count}",
               "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
               "--tokenizer", f"kind=huggingface_auto,model={HF_DIR}", "--output", f"kind=json,path={out}",
               "--disable-console"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if workers:
            env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(workers)
        subprocess.run(cmd, check=True, cwd=tmp, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(out.read_text())["benchmarks"][0]


def guidellm_at(url: str, rate: float, seconds: float, output_len: int) -> tuple[float, float]:
    b = guidellm(url, "mock", f"kind=constant,rate={rate}", int(rate * seconds), 2, output_len)
    done = b["requests"]["successful"]
    if len(done) < int(rate * seconds):
        return float("inf"), 0.0
    timings = [r["info"]["timings"] for r in done]
    lags = [(t["request_start"] - t["targeted_start"]) * 1000 for t in timings]
    span = max(t["request_start"] for t in timings) - min(t["request_start"] for t in timings)
    return statistics.quantiles(lags, n=100)[98], (len(done) - 1) / span if span else 0.0


def capacity(name: str, measure, rates: list[float]) -> tuple[float, float]:
    """(highest rate kept on time, highest rate merely achieved): the first is the tool's capacity, the
    second what it can push when send-time precision is not asked for."""
    on_time = achieved_best = 0.0
    for rate in rates:
        lag, achieved = measure(rate)
        reached = achieved >= MIN_ACHIEVED * rate
        ok = lag <= LAG_LIMIT_MS and reached
        print(f"  {name:22s} rate {rate:6.0f}/s: p99 send lag {lag:8.2f} ms, achieved {achieved:7.1f} req/s  "
              f"{'ok' if ok else 'FALLS BEHIND'}")
        on_time = rate if ok else on_time
        achieved_best = rate if reached else achieved_best
    return on_time, achieved_best


def agreement(n: int, input_len: int, output_len: int) -> None:
    """Both tools on the same burstgate gateway twice: in front of a mock engine with fixed delays (a server
    no client slows down: pure measurement), and serving SmolLM2 on this CPU (the tools' own CPU use is
    taken from the server they measure, so that difference is the client's cost, not a measurement error)."""
    tokenizer = load_tokenizer(str(HF_DIR))
    specs = synthetic(tokenizer, n, input_len, output_len, seed=0)
    # Other prompts: warming up on the measured ones would serve them from the prefix cache.
    warm_up = synthetic(tokenizer, 8, input_len, output_len, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        mock_port = free_port()
        config = Path(tmp) / "gateway.yaml"
        config.write_text(f"models: [{{name: mock, deployments: [{{kind: openai, url: 'http://127.0.0.1:{mock_port}/v1',"
                          f" upstream_model: mock}}]}}]\n")
        servers = [
            ("burstgate gateway in front of a mock engine (TTFT 200 ms + 20 ms per token)", "mock",
             ["serve", "--config", str(config), "--log-level", "warning"]),
            ("burstgate serving SmolLM2 on this CPU", "SmolLM2-135M-Instruct", ["serve", "--log-level", "warning"]),
        ]
        mock = subprocess.Popen([str(BURSTGATE), "loadtest", "mock-server", "--ttft-ms", "200", "--itl-ms", "20",
                                 "--port", str(mock_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(f"http://127.0.0.1:{mock_port}", 60, mock)
            for title, model, command in servers:
                port = free_port()
                server = subprocess.Popen([str(BURSTGATE), *command, "--port", str(port)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                try:
                    wait_ready(f"http://127.0.0.1:{port}", 300, server)
                    compare(title, f"http://127.0.0.1:{port}", model, specs, warm_up, input_len, output_len)
                finally:
                    server.terminate()
                    server.wait(timeout=60)
        finally:
            mock.terminate()
            mock.wait(timeout=30)


def compare(title: str, url: str, model: str, specs: list[RequestSpec], warm_up: list[RequestSpec], input_len: int,
            output_len: int) -> None:
    n = len(specs)
    target = Target(url, model)
    cfg = RunConfig(request=RequestOptions(endpoint="chat", ignore_eos=True))
    asyncio.run(run_target(target, warm_up, cfg))  # outside both measurements
    cpu = time.process_time()
    result = asyncio.run(run_target(target, specs, cfg))
    ours = result.summary
    ours_spread = max(r.actual_send for r in result.records) - min(r.actual_send for r in result.records)
    ours_cpu = time.process_time() - cpu
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    theirs = guidellm(url, model, f"kind=concurrent,streams={n}", n, input_len, output_len,
                      AGREEMENT_GUIDELLM_WORKERS)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    theirs_cpu = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    m, done = theirs["metrics"], theirs["requests"]["successful"]
    # guidellm's own output rate is a time-bucketed mean; recomputed from its records as vLLM defines it
    # (output tokens / first send to last completion) it measures the same thing as ours.
    span = max(r["request_end_time"] for r in done) - min(r["request_start_time"] for r in done)
    rows = [("output tok/s", ours["output_throughput"], sum(r["output_tokens"] for r in done) / span,
             m["output_tokens_per_second"]["successful"]["mean"]),
            ("median TTFT ms", ours["median_ttft_ms"], statistics.median(r["time_to_first_token_ms"] for r in done),
             m["time_to_first_token_ms"]["successful"]["median"])]
    print(f"\n{title}: burst of {n} chat requests, {input_len} in / {output_len} out "
          f"({len(done)} completed by guidellm, {ours['completed']} by burstgate):")
    for label, a, b, reported in rows:
        print(f"  {label:16s} burstgate {a:9.2f}   guidellm {b:9.2f} (its summary: {reported:9.2f})   "
              f"difference {100 * (a - b) / b:+6.1f}%")
    # An engine starts its first step with whatever has arrived; a burst sent over a longer span leaves
    # more requests to the next step, so median TTFT on a CPU-served engine follows the send spread.
    starts = [r["request_start_time"] for r in done]
    print(f"  burst sent over  burstgate {1000 * ours_spread:9.2f} ms  guidellm {1000 * (max(starts) - min(starts)):9.2f} ms")
    # On a CPU-served model the tester's own CPU time is taken from the server it measures.
    print(f"  client CPU time  burstgate {ours_cpu:9.2f} s   guidellm {theirs_cpu:9.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="100,200,400,800,1600,3200")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--agreement-requests", type=int, default=8)
    ap.add_argument("--agreement-input-len", type=int, default=128)
    ap.add_argument("--agreement-output-len", type=int, default=128)
    ap.add_argument("--agreement-only", action="store_true")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    have_guidellm = GUIDELLM.exists()
    if have_guidellm:
        export_hf_dir()  # guidellm's tokenizer, offline
    else:
        print(f"guidellm not installed ({GUIDELLM}): `make peers-guidellm`; measuring burstgate only")
    if args.agreement_only and have_guidellm:
        agreement(args.agreement_requests, args.agreement_input_len, args.agreement_output_len)
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    mock = subprocess.Popen([str(BURSTGATE), "loadtest", "mock-server", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = {}
    try:
        wait_ready(url, 60, mock)
        print(f"Capacity against the instant mock server (p99 send lag <= {LAG_LIMIT_MS} ms, "
              f">= {MIN_ACHIEVED:.0%} of the rate achieved):")
        for workers in (int(w) for w in args.workers.split(",")):
            results[f"burstgate, {workers} worker(s)"] = capacity(
                f"burstgate x{workers}", lambda r, w=workers: ours_at(url, r, args.seconds, w, args.output_len), rates)
        if have_guidellm:
            results["guidellm"] = capacity("guidellm", lambda r: guidellm_at(url, r, args.seconds, args.output_len),
                                           rates)
    finally:
        mock.terminate()
        mock.wait(timeout=30)
    print()
    for name, (on_time, reached) in results.items():
        print(f"  {name:24s} capacity {on_time:6.0f} req/s on time (p99 lag <= {LAG_LIMIT_MS} ms), "
              f"{reached:6.0f} req/s achieved")
    if "guidellm" in results:
        for i, what in enumerate(("on time", "achieved")):
            ours = max(v[i] for k, v in results.items() if k.startswith("burstgate"))
            theirs = results["guidellm"][i]
            ratio = f"{ours / theirs:.2f}x" if theirs else f"inf (guidellm: none of the rates {what})"
            print(f"  burstgate / guidellm, {what}: {ratio} (goal >= 2x)")
    if have_guidellm:
        agreement(args.agreement_requests, args.agreement_input_len, args.agreement_output_len)


if __name__ == "__main__":
    main()
