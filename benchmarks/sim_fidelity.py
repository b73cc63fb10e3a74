"""How close the simulator comes to what it simulates, on this machine.

1. ``fidelity``: the native engine served here (``burstgate serve``, SmolLM2, the CPU defaults) loaded by
   ``burstgate loadtest run`` on each workload (a mixed burst, the paper's burst scaled down, a Poisson run,
   multi-turn conversations), against a simulated replica with this machine's CPU profile on the same requests
   (the real run's prompt and output lengths and send times, replayed on the virtual clock; conversations chained
   on simulated answers with the real run's prompt growth per turn). The profile was fitted on other steps (the
   bursts of ``burstgate sim fit --native``), so these workloads are held out. Goal: output tok/s, TTFT p50 and
   p99, TPOT p50 within 15%.
   Both are compared with the front end this machine's served path adds (HTTP, the gateway, tokenizing:
   calibrated once on a lone, unloaded simulated replica served here, ``frontend_s``) and with an ideal one.
   With ``--gpu FILE`` (a result of ``gpu_check.py``'s loadtest part, e.g. benchmarks/results/gpu_loadtest_h200.json),
   the same comparison against the 12.3B model served on a GPU: each stored run and capacity probe replayed on that
   GPU's profile (fitted on the step grid of ``gpu_check.py``'s steps part, so these are held out too), and the
   paper's burst of the served part (a burst needs no stored requests); the ideal front end only, for the device's
   is not this machine's.
2. ``agreement``: ``--replicas`` simulated replicas of the design's 12.3B model on the H100 profile served in real
   time behind one gateway (least-outstanding routing) and loaded over HTTP, against the same fleet on the virtual
   clock on the same requests. Goal: within 10%.

    python benchmarks/sim_fidelity.py --profile backends/sim/profiles/cpu-epyc-2c.json \\
        --save benchmarks/results/sim_fidelity.json
    python benchmarks/sim_fidelity.py --profile backends/sim/profiles/cpu-zen4-2c.json \\
        --profile backends/sim/profiles/cpu-zen4-2c-served.json --skip agreement    # two profiles, the same runs
    python benchmarks/sim_fidelity.py --profile new.json --skip agreement --replay /tmp/sim-fidelity-xxxx \
        --sim-seed 10    # another profile, or other draws, against real runs kept earlier (--runs DIR)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import loadtest, loadtest_result, positive_int, run_record
from served_burst import MODEL, serve_model

WORKLOADS = {  # loadtest options; all with fixed outputs (ignore_eos), seed 0
    "mixed": ["--requests", "64", "--input-len", "32:512", "--output-len", "16:256"],
    "paper_scaled": ["--requests", "32", "--input-len", "512", "--output-len", "64"],
    "poisson": ["--requests", "60", "--input-len", "128", "--output-len", "32", "--rate", "1", "--schedule", "poisson"],
    "multi_turn": ["--endpoint", "chat", "--users", "8", "--turns", "4", "--system-prompt-len", "256", "--question-len", "32",
                   "--output-len", "32"],
}
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")
DESIGN = "configs/llama-12.3b-gqa.json"
ROUTING = "least_outstanding"  # served and simulated fleets alike


def replayed(result: dict) -> list:
    """The requests of a real run as the simulator takes them: its lengths, sent when they were sent."""
    from backends.sim.virtual import SimRequest, burst_workload

    start = min(result["start_times"])
    requests = []
    for i, (n_in, n_out, sent) in enumerate(zip(result["input_lens"], result["output_lens"], result["start_times"])):
        (prompt,) = burst_workload(1, n_in, n_out, [sent - start], seed=i)
        requests.append(SimRequest(prompt.at_s, prompt.prompt, n_out))
    return requests


def conversations(result: dict, users: int, turns: int, output_len: int, cached: list[int] | None = None) -> list:
    """Conversations whose first prompt and growth per turn are the real run's (template tokens included); the
    first prompt is taken as shared, as sim_fidelity's runs have no per-user history (--user-history-len). With
    ``cached`` (each real request's cached prompt tokens, in the run's order: user by user, turn by turn), each
    later turn's history comes back as it did to the real server, user by user: as far as its cache found it, the
    rest re-rendered (``SimTurn.kept``: an answer generated past its end-of-turn token with ignore_eos does not
    tokenize back to the ids generated, and where the text tokenizes otherwise differs from answer to answer)."""
    from backends.sim.virtual import conversation_workload

    lengths = sorted(result["input_lens"])
    first, last = lengths[0], lengths[-1]
    question = (last - first) // (turns - 1) - output_len  # each turn adds an answer and a question
    kept = None
    if cached is not None:  # the load tester numbers user u's turn k u * turns + k
        if len(cached) != users * turns:
            raise ValueError(f"{len(cached)} requests answered, not {users} users x {turns} turns")
        kept = [cached[u * turns + 1:(u + 1) * turns] for u in range(users)]
    return conversation_workload(users, turns, first - question, question, output_len, [0.0] * users, kept=kept)


def conversation_shape(options: list[str]) -> tuple[int, int, int]:
    """Users, turns and output length of a multi-turn workload's loadtest options."""
    users, turns, output_len = (int(options[options.index(o) + 1]) for o in ("--users", "--turns", "--output-len"))
    return users, turns, output_len


def cached_tokens(out: Path) -> list[int]:
    """Each request's cached prompt tokens as the server reported them, in the order of the run's result."""
    (records,) = out.glob("*/requests-0.jsonl")
    rows = sorted((json.loads(line) for line in records.read_text().splitlines()), key=lambda r: r["index"])
    return [r["cached_tokens"] or 0 for r in rows]


def simulate(engine: dict, replicas: int, requests: list, frontend_s: float = 0.0,
             routing: str = ROUTING, seed: int = 0) -> dict:
    from backends.native.config import EngineConfig
    from backends.sim.cli import routing_config
    from backends.sim.virtual import VirtualFleet, engine_tokenizer

    config = EngineConfig(**engine)
    fleet = VirtualFleet(config, replicas, routing_config(routing), engine_tokenizer(config), seed=seed,
                         frontend_s=frontend_s)
    return fleet.run(requests).summary


def compare(real: dict, simulated: dict) -> dict:
    return {m: {"real": real[m], "simulated": simulated[m], "ratio": simulated[m] / real[m] if real[m] else None}
            for m in METRICS}


def stored(out: Path) -> dict:
    """The result of a real run kept in ``out`` by an earlier run of this script (``--runs``), for ``--replay``."""
    try:
        return loadtest_result(out)
    except FileNotFoundError as exc:
        raise SystemExit(f"{exc}: no stored real run to replay (a folder --runs kept)") from None


def calibrate_frontend(out: Path, replay: bool = False) -> float:
    """Seconds the served path adds before a request's engine sees it (HTTP, the gateway, tokenizing): the median
    TTFT of a lone simulated replica, unloaded (20 requests at 2/s), served and loaded over HTTP, less the same on
    the virtual clock with an ideal front end. With ``replay``, that run as ``out`` keeps it."""
    engine = {"model_path": DESIGN, "simulate": {"profile": "h100"}}
    if replay:
        result = stored(out / "frontend")
    else:
        with contextlib.ExitStack() as stack:
            url = serve_model(stack, [{"kind": "native", "name": "replica", **engine}], ROUTING)
            result = loadtest(f"{url}#{MODEL}", out / "frontend", "--requests", "20", "--input-len", "512",
                              "--output-len", "16", "--rate", "2", "--schedule", "poisson", "--seed", "1",
                              log=out / "frontend.log")
    simulated = simulate(engine, 1, replayed(result))
    return (result["median_ttft_ms"] - simulated["median_ttft_ms"]) / 1e3


def fidelity(profiles: list[str], workloads: list[str], frontend_s: float, out: Path, rounds: int = 1,
             replay: bool = False, sim_seed: int = 0) -> dict[str, dict]:
    """Per profile, per workload: simulated against real, the same requests (the real runs shared by every
    profile). With ``rounds``, each workload runs that many times on fresh prompts (seeds 0, 1, ...) and each
    figure is the median real against the median of the rounds' simulated twins: a real run on two shared cores
    moves by 10-30% from one round to the next, the simulator only by its draws from a profile's step spread
    (seeded by the round, plus ``sim_seed``). With ``replay``, the real runs are the ones ``out`` keeps."""
    rows: dict[str, dict] = {profile: {} for profile in profiles}
    with contextlib.ExitStack() as stack:
        url = None if replay else serve_model(stack, [{"kind": "native", "name": "native"}], ROUTING)
        for name in workloads:
            pairs: dict[str, dict[str, list]] = {p: {"with_frontend": [], "ideal_frontend": []} for p in profiles}
            for seed in range(rounds):
                run = out / f"{name}-{seed}"
                result = (stored(run) if url is None else
                          loadtest(f"{url}#{MODEL}", run, *WORKLOADS[name], "--seed", str(seed), log=run.with_suffix(".log")))
                requests = (conversations(result, *conversation_shape(WORKLOADS[name]), cached_tokens(run))
                            if name == "multi_turn" else replayed(result))
                drawn = seed + sim_seed
                for profile in profiles:
                    engine = {"simulate": {"profile": profile}}
                    pairs[profile]["with_frontend"].append((result, simulate(engine, 1, requests, frontend_s, seed=drawn)))
                    pairs[profile]["ideal_frontend"].append((result, simulate(engine, 1, requests, seed=drawn)))
            for profile in profiles:
                rows[profile][name] = {kind: compare_rounds(p) for kind, p in pairs[profile].items()}
                print(name, profile, _ratios(rows[profile][name]), flush=True)
    return rows


def compare_rounds(pairs: list[tuple[dict, dict]]) -> dict:
    """``compare`` of the median real and the median simulated figure over rounds of (real, simulated) runs, with
    each round's own ratio."""
    row = compare({m: statistics.median(real[m] for real, _ in pairs) for m in METRICS},
                  {m: statistics.median(sim[m] for _, sim in pairs) for m in METRICS})
    for m in METRICS:
        row[m]["rounds"] = [sim[m] / real[m] if real[m] else None for real, sim in pairs]
    return row


def gpu_fidelity(path: Path, profile: str, served: Path | None) -> dict:
    """Each run and capacity probe of a GPU loadtest result replayed on ``profile``; with ``served`` (a gpu_check
    result with the served part), the paper's burst too."""
    from backends.sim.virtual import burst_workload

    record = json.loads(path.read_text())
    if "parts" in record:  # gpu_check.py's own record, as a lease leaves it
        record = record["parts"]["loadtest"]["result"]
    deployment = record["deployment"]
    engine = {"model_path": DESIGN, "simulate": {"profile": profile},
              **{k: deployment[k] for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens")}}
    rows = {}
    for name, run in record["runs"].items():
        if name == "multi_turn":
            requests = conversations(run, *conversation_shape(record["workloads"][name]))
        else:
            requests = replayed(run)
        rows[name] = compare(run, simulate(engine, 1, requests))
    capacity = record.get("capacity", {"answer": {"probes": []}, "probes": []})  # a run may have no search
    for probe, run in zip(capacity["answer"]["probes"], capacity["probes"]):
        name = f"capacity {probe['role']}" + (f" {probe['rate']:.1f} req/s" if probe["rate"] else "")
        rows[name] = compare(run, simulate(engine, 1, replayed(run)))
    if served is not None:
        part = json.loads(served.read_text())["parts"]["served"]["result"]
        paper = part["paper"]
        engine = {**engine, **{k: part["deployment"][k] for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens")}}
        rows["paper burst (served part)"] = compare(paper, simulate(engine, 1, burst_workload(1000, 512, 128, [0.0] * 1000)))
    for name, row in rows.items():
        print(f"{name:34s}", json.dumps({m: round(v["ratio"], 3) for m, v in row.items()}), flush=True)
    return rows


def agreement(replicas: int, rate: float, requests: int, frontend_s: float, out: Path) -> dict:
    engine = {"model_path": DESIGN, "simulate": {"profile": "h100"}, "max_num_seqs": 64}
    deployments = [{"kind": "native", "name": f"replica-{i}", **engine} for i in range(replicas)]
    with contextlib.ExitStack() as stack:
        url = serve_model(stack, deployments, ROUTING)
        result = loadtest(f"{url}#{MODEL}", out / "agreement", "--requests", str(requests), "--input-len", "512",
                          "--output-len", "128", "--rate", str(rate), "--schedule", "poisson", "--seed", "0",
                          log=out / "agreement.log")
    sent = replayed(result)
    row = {"with_frontend": compare(result, simulate(engine, replicas, sent, frontend_s)),
           "ideal_frontend": compare(result, simulate(engine, replicas, sent))}
    print("agreement", _ratios(row), flush=True)
    return row


def _ratios(row: dict) -> str:
    return json.dumps({kind: {m: round(v["ratio"], 3) for m, v in metrics.items()} for kind, metrics in row.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="append", required=True,
                    help="this machine's CPU profile (burstgate sim fit); repeat to compare several on the same real "
                         "runs (the first is the file's `fidelity`); with --gpu, that GPU's (e.g. h200)")
    ap.add_argument("--gpu", type=Path, metavar="FILE", help="compare with this GPU loadtest result instead (no server "
                                                             "is started here): a gpu_loadtest_*.json, or the "
                                                             "gpu_check.json of a run with the loadtest part")
    ap.add_argument("--gpu-served", type=Path, metavar="FILE", help="with --gpu: a gpu_check result whose served "
                                                                    "part's paper burst is compared too")
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    ap.add_argument("--replicas", type=int, default=4, help="fleet size of the real-time/virtual agreement")
    ap.add_argument("--rate", type=float, default=20.0, help="its arrival rate (req/s)")
    ap.add_argument("--requests", type=int, default=300, help="its requests")
    ap.add_argument("--skip", action="append", default=[], choices=["fidelity", "agreement"])
    ap.add_argument("--rounds", type=positive_int, default=3, help="real runs of each fidelity workload (medians compared)")
    ap.add_argument("--runs", type=Path, metavar="DIR", help="keep the real runs in this folder (default: a new "
                                                             "temporary one, printed)")
    ap.add_argument("--replay", type=Path, metavar="DIR", help="simulate against the real runs a folder of --runs "
                                                               "keeps instead of running them (no server started)")
    ap.add_argument("--sim-seed", type=int, default=0, metavar="N", help="added to each round's seed of the "
                                                                         "simulator's step-spread draws")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    record = run_record()
    if args.gpu:
        record["gpu"] = {"real": str(args.gpu), "profile": args.profile[0],
                         "fidelity": gpu_fidelity(args.gpu, args.profile[0], args.gpu_served)}
        if args.save:
            args.save.write_text(json.dumps(record, indent=1) + "\n")
        return
    if args.replay and args.runs:
        ap.error("--replay reads the runs a folder keeps; --runs keeps new ones")
    if args.replay and "agreement" not in args.skip:
        ap.error("--replay replays the fidelity runs only: add --skip agreement")
    replay = args.replay is not None
    if replay and not args.replay.is_dir():
        ap.error(f"--replay {args.replay}: no such folder")
    out = args.replay or args.runs or Path(tempfile.mkdtemp(prefix="sim-fidelity-"))
    out.mkdir(parents=True, exist_ok=True)  # --runs may name a new one
    print(f"real runs: {out}{' (replayed)' * replay}", flush=True)
    record["frontend_s"] = frontend_s = calibrate_frontend(out, replay)
    print(f"front end: {frontend_s * 1e3:.1f} ms", flush=True)
    if "fidelity" not in args.skip:
        by_profile = fidelity(args.profile, args.workload or list(WORKLOADS), frontend_s, out, args.rounds, replay,
                              args.sim_seed)
        record["profile"], record["fidelity"] = args.profile[0], by_profile[args.profile[0]]
        if len(args.profile) > 1:
            record["fidelity_by_profile"] = by_profile
    if "agreement" not in args.skip:
        record["agreement"] = {"replicas": args.replicas, "rate": args.rate, "requests": args.requests,
                               **agreement(args.replicas, args.rate, args.requests, frontend_s, out)}
    if args.save:
        args.save.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
