"""Routing across a fleet of native engine replicas, every router in front of the same replicas, in one run.

Replicas: ``--replicas`` native engines, each ``burstgate serve`` of the embedded SmolLM2 in a process of its own
with one CPU thread, pinned round-robin to the machine's cores (4 on 2 cores: two per core), publishing their KV
events; each replica's own /metrics gives its prefix-cache hit counters and request count.
Routers: a burstgate gateway per policy (round_robin, least_outstanding, prefix_affinity, cache_aware kept from
its own decisions, cache_aware following the replicas' KV events), and where installed (``make peers-routers``)
SGLang's router (``--policy cache_aware``) and vLLM's router (``--policy cache_aware``, and ``--policy kv_aware``
reading the replicas' KV events: ``vllm-router-kv``) in front of the same replicas.
Workloads (burstgate's load tester, one client for all, chat completions: SGLang's router serves no other route in
its OpenAI mode): multi-round QA (production-stack's shape: a shared system prompt, each user's own history,
questions after a think time), multi-turn (users x turns, each turn sent as soon as the last was answered),
shared-prefix (groups of prompts behind a few long shared prefixes) and random prompts.
With ``--two-gateways POLICY``, two gateways of that policy behind HAProxy (HTTP mode, round robin request by
request, as gateway replicas behind a Service): a conversation's turns alternate between them, each gateway routing
on what the engines report, not on its own half of the traffic.
Each (workload, router) gets fresh prompts (its own seed): no cache carries over between runs. Rounds interleave
the routers, their order alternating. Reported per run: output tok/s, TTFT p50/p99, the replicas' prefix-cache
hit rate over the run (their own counters) and the workload's ceiling (``hit_rate_ceiling``: what one replica that
kept every block would have found), requests per replica; medians over rounds.

    python benchmarks/fleet_routing.py --rounds 2 --save benchmarks/results/fleet_routing.json

With ``--simulate h100``, the replicas are simulated 12.3B replicas on the H100 profile (backends/sim), served in
real time: the routers compared at GPU speeds on this machine. With ``--engine vllm``, the replicas are real vLLM
(the CPU build, ``make peers``: the exported SmolLM2 in fp32, one core each, 32-token blocks, the least its CPU
attention takes, its KV events on):

    python benchmarks/fleet_routing.py --engine vllm --replicas 2 --rounds 1 --save benchmarks/results/fleet_routing_vllm.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import PEERS, burstgate, free_port, loadtest, run_record, serving, start_vllm

from backends.native.block_hash import block_hashes
from loadtest.metrics import server_hit_rate
from loadtest.session import prompt_seed
from loadtest.workload import LocalCounter, conversations, fit, load_tokenizer, synthetic

MODEL = "smollm2"
ROUTERS_PYTHON = PEERS / "routers" / "bin" / "python"
WORKLOADS = {
    # vLLM production-stack's multi-round QA (--shared-system-prompt 1000 --user-history-prompt 2000 --answer-len
    # 100 --num-rounds 5, a user's next question a while after its answer), scaled to these CPU replicas
    "multi-round-qa": ["--endpoint", "chat", "--users", "24", "--turns", "4", "--system-prompt-len", "96",
                       "--user-history-len", "256", "--question-len", "32", "--output-len", "16", "--think-time", "1"],
    # the same with users joining over time, as production-stack's do (2 a second), instead of all at t = 0
    "multi-round-qa-joining": ["--endpoint", "chat", "--users", "24", "--turns", "4", "--system-prompt-len", "96",
                               "--user-history-len", "256", "--question-len", "32", "--output-len", "16",
                               "--think-time", "1", "--schedule", "constant", "--rate", "2"],
    "multi-turn": ["--endpoint", "chat", "--users", "16", "--turns", "4", "--system-prompt-len", "192",
                   "--question-len", "48", "--output-len", "16"],
    "shared-prefix": ["--endpoint", "chat", "--requests", "64", "--input-len", "448", "--prefix-len", "384",
                      "--num-prefixes", "4", "--output-len", "16"],
    "random": ["--endpoint", "chat", "--requests", "64", "--input-len", "256", "--output-len", "16"],
    # for simulated GPU replicas (--simulate): production-stack's multi-round QA shape, scaled to fit real time here
    "multi-turn-gpu": ["--endpoint", "chat", "--users", "48", "--turns", "4", "--system-prompt-len", "1000",
                       "--question-len", "200", "--output-len", "64", "--think-time", "1"],
}
# gateway targets: a policy, optionally @ cache_aware's load_cost_tokens; _precise follows the replicas' KV events
POLICIES = ["round_robin", "least_outstanding", "prefix_affinity", "cache_aware@256", "cache_aware@64",
            "cache_aware_precise@64", "cache_aware@auto", "cache_aware_precise@auto"]
HAPROXY = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")  # `make system-packages`
BLOCK_SIZE = {"native": 16, "vllm": 32}  # tokens per KV block of each engine (vLLM's CPU attention: a multiple of 32)
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "p90_ttft_ms", "completed", "failed")


def start_replica(stack: contextlib.ExitStack, index: int, logs: Path, engine: str, simulate: str | None = None
                  ) -> tuple[str, str]:
    """One replica, the ``engine`` on one core of its own: burstgate's native engine (or, with ``simulate``, a
    simulated replica of the design's 12.3B model on that device profile, in real time) or vLLM; its URL and the
    endpoint of its KV events."""
    port, events = free_port(), free_port()
    kv_events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{events}"}
    core = str(index % os.cpu_count())
    if engine == "vllm":
        vllm_events = {**kv_events, "publisher": "zmq", "endpoint": f"tcp://*:{events}"}
        proc = start_vllm(port, log=logs / f"replica-{index}.log", cpus=core, extra_args=(
            "--block-size", str(BLOCK_SIZE[engine]), "--kv-events-config", json.dumps(vllm_events)))
        stack.callback(proc.wait, timeout=60)
        stack.callback(proc.terminate)
        return f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events}"
    if simulate:
        deployment = {"kind": "native", "model_path": "configs/llama-12.3b-gqa.json", "simulate": {"profile": simulate},
                      "max_num_seqs": 64, "max_num_batched_tokens": 4096, "block_size": 16, "max_concurrency": 512,
                      "kv_events_config": kv_events}
    else:
        deployment = {"kind": "native", "dtype": "float32", "num_threads": 1, "max_num_seqs": 32,
                      "max_num_batched_tokens": 512, "kv_cache_gb": 0.5, "block_size": BLOCK_SIZE[engine],
                      "max_concurrency": 512,
                      "kv_events_config": kv_events}
    config = Path(tempfile.mkdtemp()) / "replica.json"
    config.write_text(json.dumps({"models": [{"name": MODEL, "deployments": [deployment]}]}))
    serve = burstgate("serve", "--port", str(port), "--config", str(config), "--log-level", "warning")
    cmd = serve if simulate else ["taskset", "-c", core, *serve]  # a simulated replica sleeps through its steps
    url = stack.enter_context(serving(cmd, port, log=logs / f"replica-{index}.log"))
    return url, f"tcp://127.0.0.1:{events}"


def gateway_command(target: str, replicas: list[tuple[str, str]], port: int, block_size: int) -> list[str]:
    policy, _, cost = target.partition("@")
    precise = policy == "cache_aware_precise"
    deployments = [{"kind": "openai", "name": f"replica-{i}", "url": f"{url}/v1", "upstream_model": MODEL,
                    "max_concurrency": 512, "max_queue": 4096, **({"kv_events": events} if precise else {})}
                   for i, (url, events) in enumerate(replicas)]
    routing = {"policy": policy.removesuffix("_precise")}
    if routing["policy"] == "cache_aware":  # the replicas' tokenizer, read here: no /tokenize call per request
        from backends.native.weights import default_model_path

        load_cost = {"load_cost_tokens": cost if cost == "auto" else float(cost)} if cost else {}
        routing.update(block_size=block_size, tokenizer=str(default_model_path()), **load_cost)
    config = Path(tempfile.mkdtemp()) / "gateway.json"
    config.write_text(json.dumps({"models": [{"name": MODEL, "routing": routing, "deployments": deployments}]}))
    return burstgate("serve", "--port", str(port), "--config", str(config), "--log-level", "warning")


def two_gateways(stack: contextlib.ExitStack, policy: str, replicas: list[tuple[str, str]], block_size: int,
                 logs: Path) -> str:
    """Two gateways of ``policy`` in front of ``replicas``, behind HAProxy balancing request by request: its URL."""
    if HAPROXY is None:
        raise RuntimeError("haproxy is not installed (make system-packages)")
    ports = [free_port(), free_port()]
    for k, port in enumerate(ports):
        stack.enter_context(serving(gateway_command(policy, replicas, port, block_size), port,
                                    log=logs / f"gateway-{policy}-{k}.log"))
    listen = free_port()
    config = logs / f"haproxy-{policy}.cfg"
    config.write_text("\n".join([
        "defaults", "  mode http", "  timeout connect 2s", "  timeout client 600s", "  timeout server 600s",
        "frontend gateways", f"  bind 127.0.0.1:{listen}", "  default_backend gateways",
        "backend gateways", "  balance roundrobin", *(f"  server g{k} 127.0.0.1:{port}" for k, port in enumerate(ports))
    ]) + "\n")
    return stack.enter_context(serving([HAPROXY, "-f", str(config)], listen, log=logs / f"haproxy-{policy}.log"))


def router_command(kind: str, replicas: list[tuple[str, str]], port: int, block_size: int) -> list[str]:
    """The field's router ``kind`` in front of ``replicas``: SGLang's and vLLM's ``cache_aware`` (an approximate
    tree of their own routing), or vLLM's ``kv_aware`` (``vllm-router-kv``: an index of the replicas' KV events)."""
    urls = [url for url, _ in replicas]
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()), "--worker-urls", *urls]
    if kind == "sglang-router":
        return [str(ROUTERS_PYTHON), "-m", "sglang_router.launch_router", "--backend", "openai", "--policy",
                "cache_aware", *common]
    vllm_router = str(ROUTERS_PYTHON.parent / "vllm-router")
    if kind == "vllm-router-kv":
        sources = [a for url, events in replicas for a in ("--kv-event-source", f"{url}={events}")]
        return [vllm_router, "--policy", "kv_aware", *sources, "--kv-event-block-size", str(block_size),
                "--kv-event-model", MODEL, *common]
    return [vllm_router, "--policy", "cache_aware", *common]


def replica_figures(replicas: list[tuple[str, str]]) -> tuple[dict, list[float]]:
    """The replicas' metrics samples summed by name{labels}, and each replica's finished requests."""
    from prometheus_client.parser import text_string_to_metric_families

    total: dict[str, float] = {}
    requests = []
    for url, _ in replicas:
        count = 0.0
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            for s in family.samples:
                key = s.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}"
                total[key] = total.get(key, 0.0) + s.value
                if s.name in ("burstgate:requests_total", "vllm:request_success_total"):
                    count += s.value
        requests.append(count)
    return total, requests


def hit_rate_ceiling(workload: list[str], seed: int, result: dict, block_size: int) -> float | None:
    """The workload's maximum prefix-cache hit rate: every prompt of the run (rebuilt as the load tester built
    them from ``--seed`` ``seed``, with the answers the run got, rendered through the chat template as the replicas
    render it), in the order sent, finding every full block that any earlier request of the run computed (its
    prompt and its answer but the answer's last token, whose KV nobody computes); an engine recomputes a prompt's
    last token, so a prompt's last block counts only when a token follows it. One replica that kept every block
    would reach it; a fleet reaches it only by sending each prompt where its blocks are. Blocks cached by earlier
    runs (the chat template's opening, the same in every prompt) are not counted: a replica can find a little more.
    None when the run's requests are not the workload's (a failed turn ends its conversation) or the replicas
    counted other prompts."""
    tokenizer = load_tokenizer(None)
    opts = dict(zip(workload[::2], workload[1::2]))  # every option here takes a value
    number = {k: int(v) for k, v in opts.items() if v.isdigit()}
    built = prompt_seed(seed, 0, 0)  # the first target's first point, as loadtest/session.py seeds it
    if "--users" in number:  # the load tester's defaults where the workload leaves an option out
        specs = conversations(tokenizer, number["--users"], number.get("--turns", 1),
                              number.get("--system-prompt-len", 0), number.get("--question-len", 64),
                              number["--output-len"], built, number.get("--user-history-len", 0))
    else:  # fitted to the replicas' counts as the load tester fits them (the same tokenizer and template here)
        specs = asyncio.run(fit(synthetic(tokenizer, number["--requests"], number["--input-len"],
                                          number["--output-len"], built, number.get("--prefix-len", 0),
                                          number.get("--num-prefixes", 1)),
                                LocalCounter(tokenizer, chat=True, name="replica's")))
    if len(specs) != len(result["generated_texts"]):
        return None
    histories: dict[int, list[dict]] = {}
    prompts: list[tuple[list[int], list[int]]] = []  # per request: its prompt, and the tokens it computed
    for spec, answer in zip(specs, result["generated_texts"], strict=True):  # the runner's order of turns
        history = histories.get(spec.conversation, [{"role": "system", "content": spec.system}] if spec.system else [])
        messages = [*history, {"role": "user", "content": spec.prompt}]
        prompt = tokenizer.apply_chat_template(messages)
        answered = [*messages, {"role": "assistant", "content": answer}]  # rendered as the next turn carries it
        computed = tokenizer.apply_chat_template(answered)[:len(prompt) + len(tokenizer.encode(answer)) - 1]
        prompts.append((prompt, computed))
        if spec.conversation is not None:
            histories[spec.conversation] = answered
    if [len(prompt) for prompt, _ in prompts] != result["input_lens"]:
        return None
    seen: set[bytes] = set()  # the engines' chained block keys
    found = total = 0
    for i in sorted(range(len(prompts)), key=lambda i: result["start_times"][i]):
        prompt, computed = prompts[i]
        total += len(prompt)
        for key in block_hashes(prompt[:-1], block_size):  # leading full blocks, the last token excluded
            if key not in seen:
                break
            found += block_size
        seen.update(block_hashes(computed, block_size))
    return found / total


def measure(target_url: str, workload: str, seed: int, replicas, logs: Path, name: str, block_size: int) -> dict:
    before, requests_before = replica_figures(replicas)
    out = Path(tempfile.mkdtemp())
    result = loadtest(f"{target_url}#{MODEL}", out, *WORKLOADS[workload], "--temperature", "0", "--warmup", "0",
                      "--seed", str(seed), log=logs / f"{name}-{workload}-{seed}.log")
    after, requests_after = replica_figures(replicas)
    row = {k: result.get(k) for k in METRICS}
    row["replica_hit_rate"] = server_hit_rate(before, after)
    row["hit_rate_ceiling"] = hit_rate_ceiling(WORKLOADS[workload], seed, result, block_size)
    row["requests_per_replica"] = [a - b for a, b in zip(requests_after, requests_before, strict=True)]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    ap.add_argument("--policy", action="append", choices=POLICIES, help="gateway targets (default: all)")
    ap.add_argument("--two-gateways", action="append", default=[], choices=POLICIES,
                    help="also this policy in two gateways behind a load balancer alternating request by request")
    ap.add_argument("--no-peers", action="store_true", help="leave SGLang's and vLLM's routers out")
    ap.add_argument("--skip-peer", action="append", default=[], choices=["sglang-router", "vllm-router", "vllm-router-kv"],
                    help="leave this one of the field's routers out")
    ap.add_argument("--simulate", metavar="PROFILE", help="simulated replicas of the 12.3B model on this device "
                    "profile (backends/sim), served in real time, instead of SmolLM2 on this CPU")
    ap.add_argument("--engine", choices=("native", "vllm"), default="native", help="what each replica runs")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    workloads, policies = args.workload or list(WORKLOADS), args.policy or POLICIES
    peers = [] if args.no_peers or not ROUTERS_PYTHON.exists() else ["sglang-router", "vllm-router", "vllm-router-kv"]
    peers = [p for p in peers if p not in args.skip_peer]
    logs = Path(tempfile.mkdtemp(prefix="fleet-routing-"))
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        replicas = [start_replica(stack, i, logs, args.engine, args.simulate) for i in range(args.replicas)]
        targets = {}
        for policy in policies:
            port = free_port()
            command = gateway_command(policy, replicas, port, BLOCK_SIZE[args.engine])
            targets[policy] = stack.enter_context(serving(command, port,
                                                          log=logs / f"gateway-{policy}.log"))
        for policy in args.two_gateways:
            targets[f"{policy} x2"] = two_gateways(stack, policy, replicas, BLOCK_SIZE[args.engine], logs)
        for peer in peers:
            port = free_port()
            try:
                command = router_command(peer, replicas, port, BLOCK_SIZE[args.engine])
                targets[peer] = stack.enter_context(serving(command, port,
                                                            log=logs / f"{peer}.log", timeout_s=60))
            except (RuntimeError, TimeoutError) as exc:  # recorded: the table says why the row is missing
                runs.append({"target": peer, "error": f"{exc} (log: {logs / peer}.log)"})
        for r in range(args.rounds):
            for workload in workloads:
                order = list(targets) if r % 2 == 0 else list(reversed(targets))
                for t, name in enumerate(order):
                    seed = 1000 * r + 10 * t + workloads.index(workload)
                    started = time.perf_counter()
                    row = measure(targets[name], workload, seed, replicas, logs, name, BLOCK_SIZE[args.engine])
                    runs.append({"round": r, "workload": workload, "target": name, "seed": seed,
                                 "seconds": time.perf_counter() - started, **row})
                    print(f"round {r} {workload:14s} {name:20s} {row['output_throughput']:7.1f} tok/s  TTFT p50 "
                          f"{row['median_ttft_ms']:7.0f} ms  hit rate {row['replica_hit_rate'] or 0:.2f} "
                          f"(ceiling {row['hit_rate_ceiling'] or float('nan'):.2f})  "
                          f"per replica {row['requests_per_replica']}", flush=True)
    table = summarize(runs)
    for line in table:
        print(line)
    if args.save:
        args.save.write_text(json.dumps({**run_record(), "replicas": args.replicas, "engine": args.engine,
                                         "simulate": args.simulate,
                                         "workloads": {w: WORKLOADS[w] for w in workloads},
                                         "runs": runs, "table": table}, indent=2))


def summarize(runs: list[dict]) -> list[str]:
    """Medians over rounds per workload and target, with ratios to round robin."""
    lines = []
    measured = [r for r in runs if "workload" in r]
    for workload in dict.fromkeys(r["workload"] for r in measured):
        rows = {}
        for r in measured:
            if r["workload"] == workload:
                rows.setdefault(r["target"], []).append(r)
        base = statistics.median(r["output_throughput"] for r in rows.get("round_robin", [])) if "round_robin" in \
            rows else None
        ceilings = [r["hit_rate_ceiling"] for r in measured
                    if r["workload"] == workload and r.get("hit_rate_ceiling") is not None]
        ceiling = f" (the workload's ceiling: {statistics.median(ceilings):.2f})" if ceilings else ""
        lines.append(f"{workload}: target, output tok/s (x round robin), TTFT p50 / p99 ms, replica hit rate{ceiling}")
        for target, rs in rows.items():
            tput = statistics.median(r["output_throughput"] for r in rs)
            hit = [r["replica_hit_rate"] for r in rs if r["replica_hit_rate"] is not None]
            lines.append(f"  {target:20s} {tput:7.1f} ({tput / base if base else float('nan'):.2f}x)  "
                         f"{statistics.median(r['median_ttft_ms'] for r in rs):6.0f} / "
                         f"{statistics.median(r['p99_ttft_ms'] for r in rs):6.0f}  "
                         f"{statistics.median(hit) if hit else float('nan'):.2f}")
    return lines


if __name__ == "__main__":
    main()
