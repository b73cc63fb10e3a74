"""How close the simulator comes to what it simulates, on this machine.

1. ``fidelity``: the native engine served here (``burstgate serve``, SmolLM2, the CPU defaults) loaded by
   ``burstgate loadtest run`` on each workload (a mixed burst, the paper's burst scaled down, a Poisson run,
   multi-turn conversations), against a simulated replica with this machine's CPU profile on the same requests
   (the real run's prompt and output lengths and send times, replayed on the virtual clock; conversations chained
   on simulated answers with the real run's prompt growth per turn). The profile was fitted on other steps, so
   these workloads are held out: with ``--fit-trace`` and ``--fit-profile``, on the steps of served_steps.py's
   workloads (with its --long-turns) served by the same server in the same run, a share of them before each round
   of these and its bursts of 2,048-token steps (``FIT_EVERY_ROUND``) in every round (this host's speed drifts by
   10-20% within half an hour: a profile fitted before a check is not the machine it checks).
   Round by round, every workload runs its share of its rounds. Goal: output tok/s, TTFT p50 and p99, TPOT p50
   within 15%.
   Both are compared with the front end this machine's served path adds (HTTP, the gateway, tokenizing:
   calibrated once on a lone, unloaded simulated replica served here, ``frontend_s``; one request at a time, on
   the engine's two cores, so a step waits out the front end's queued work: ``VirtualFleet``'s
   ``frontend_shares_host``) and with an ideal one.
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
    python benchmarks/sim_fidelity.py --fit-trace steps.jsonl --fit-profile cpu.json --skip agreement \\
        --save fidelity.json    # fitted and checked in one run, interleaved
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
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # this checkout
from peers import burstgate, loadtest, loadtest_result, positive_int, run_record
from served_burst import MODEL, serve_model
from served_steps import LONG_TURNS
from served_steps import WORKLOADS as SERVED_STEPS

WORKLOADS = {  # loadtest options; all with fixed outputs (ignore_eos), seed 0
    "mixed": ["--requests", "64", "--input-len", "32:512", "--output-len", "16:256"],
    "paper_scaled": ["--requests", "32", "--input-len", "512", "--output-len", "64"],
    "poisson": ["--requests", "60", "--input-len", "128", "--output-len", "32", "--rate", "1", "--schedule", "poisson"],
    "multi_turn": ["--endpoint", "chat", "--users", "8", "--turns", "4", "--system-prompt-len", "256", "--question-len", "32",
                   "--output-len", "32"],
}
# Real runs per --rounds. A multi-turn run's TTFT p50 has one value per turn, not per request: the users a turn's
# first step leaves waiting share their next step's end. Four turns give four values, and on a 2-core host nine runs
# in one session read 803-1,208 ms (docs/performance.md): three times the rounds, 36 values.
ROUNDS_FACTOR = {"multi_turn": 3}
# the fit's workloads: served_steps.py's, with conversations over long histories (--long-turns), whose turns show
# attention's own efficiency
FIT_WORKLOADS = {**SERVED_STEPS, "multi_turn_long": LONG_TURNS}
FIT_SEED = 1000  # the fit's prompts: none of the check's (seeds 0, 1, ...), whose prefixes the cache would keep
# served every round, last before the check's bursts, not once: steps of 2,048 fresh tokens, which set the bursts'
# TTFT. This host's prompt speed moves by 20% within minutes (step_shapes_xeon.json), and the check's bursts sample it
# every round with about 15 such steps, where the fit share's others hold 1-5 a round.
FIT_EVERY_ROUND = ["burst_16x768_24", "burst_8x1024_16"]
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


def simulate(engine: dict, replicas: int, requests: list, frontend_s: float = 0.0, shares_host: bool = False,
             routing: str = ROUTING, seed: int = 0) -> dict:
    from backends.native.config import EngineConfig
    from backends.sim.cli import routing_config
    from backends.sim.virtual import VirtualFleet, engine_tokenizer

    config = EngineConfig(**engine)
    fleet = VirtualFleet(config, replicas, routing_config(routing), engine_tokenizer(config), seed=seed,
                         frontend_s=frontend_s, frontend_shares_host=shares_host)
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
             replay: bool = False, sim_seed: int = 0, fit: tuple[Path, Path] | None = None) -> dict[str, dict]:
    """Per profile, per workload: simulated against real, the same requests (the real runs shared by every
    profile). With ``rounds``, each workload runs that many times (``workload_rounds``) on fresh prompts (seeds 0,
    1, ...) and each figure is the median real against the median of the rounds' simulated twins: a real run on two
    shared cores moves by 10-30% from one round to the next, the simulator only by its draws from a profile's step
    spread (seeded by the round, plus ``sim_seed``). With ``replay``, the real runs are the ones ``out`` keeps. With
    ``fit`` (a trace file and a profile file), this machine's profile is fitted on steps served among the real runs
    (``real_runs``) and compared first."""
    runs = real_runs(workloads, out, rounds, replay, fit[0] if fit else None)
    if fit is not None:
        fit_profile(*fit)
        profiles = [str(fit[1]), *profiles]
    rows: dict[str, dict] = {profile: {} for profile in profiles}
    for name, named_runs in runs.items():
        for profile in profiles:
            pairs: dict[str, list] = {"with_frontend": [], "ideal_frontend": []}
            for seed, (result, requests) in enumerate(named_runs):
                engine, drawn = {"simulate": {"profile": profile}}, seed + sim_seed
                pairs["with_frontend"].append((result, simulate(engine, 1, requests, frontend_s, shares_host=True,
                                                                seed=drawn)))
                pairs["ideal_frontend"].append((result, simulate(engine, 1, requests, seed=drawn)))
            rows[profile][name] = {kind: compare_rounds(p) for kind, p in pairs.items()}
            print(name, profile, _ratios(rows[profile][name]), flush=True)
    return rows


def real_runs(workloads: list[str], out: Path, rounds: int, replay: bool = False,
              fit_trace: Path | None = None) -> dict[str, list[tuple[dict, list]]]:
    """Each workload's real runs in seed order, as (the load tester's result, the requests the simulator replays).
    Round by round, each workload runs its share of its rounds (``ROUNDS_FACTOR``): a host whose speed drifts over
    the session moves every workload alike. With ``fit_trace``, the server traces its steps and each round first
    serves a share of the fit's workloads (``serve_fit_share``): their steps alone go to ``fit_trace``, so the
    profile is fitted in the same minutes it is checked in. With ``replay``, the runs ``out`` keeps."""
    server_trace = out / "steps.jsonl"
    fit_steps: list[str] = []
    runs: dict[str, list] = {name: [] for name in workloads}
    last = {name: workload_rounds(name, rounds, out if replay else None) for name in workloads}
    with contextlib.ExitStack() as stack:
        url = None
        if not replay:
            traced = {"step_trace": str(server_trace)} if fit_trace else {}
            url = serve_model(stack, [{"kind": "native", "name": "native", **traced}], ROUTING)
        for r in range(rounds):
            if url is not None and fit_trace is not None:
                share = [name for name in FIT_WORKLOADS if name not in FIT_EVERY_ROUND][r::rounds]
                fit_steps += serve_fit_share(url, out, share + FIT_EVERY_ROUND, server_trace, r)
            for name in workloads:
                factor = ROUNDS_FACTOR.get(name, 1)
                seeds = range(r * factor, min((r + 1) * factor, last[name]))
                runs[name] += [real_run(url, out, name, seed) for seed in seeds]
    if fit_trace is not None:  # the server closed its trace as it stopped, the peaks measured again last
        header, *lines = trace_lines(server_trace)
        fit_trace.write_text("".join([header, *fit_steps, *(line for line in lines if line.startswith("{"))]))
        print(f"{len(fit_steps)} steps to fit -> {fit_trace}", flush=True)
    return runs


def real_run(url: str | None, out: Path, name: str, seed: int) -> tuple[dict, list]:
    """One run of workload ``name`` on the server at ``url`` (None: the run ``out`` keeps), and its requests as the
    simulator replays them."""
    run = out / f"{name}-{seed}"
    result = (stored(run) if url is None else
              loadtest(f"{url}#{MODEL}", run, *WORKLOADS[name], "--seed", str(seed), log=run.with_suffix(".log")))
    requests = (conversations(result, *conversation_shape(WORKLOADS[name]), cached_tokens(run))
                if name == "multi_turn" else replayed(result))
    return result, requests


def serve_fit_share(url: str, out: Path, names: list[str], server_trace: Path, round_: int) -> list[str]:
    """The fit's workloads ``names`` (served_steps.py's: other shapes, seeds) served at ``url`` in round ``round_``
    (its own prompts); the lines they added to the server's trace (flushed by each run's end, where the engine idles)."""
    steps = []
    for name in names:
        before = len(trace_lines(server_trace))
        run = out / f"fit-{name}-{round_}"
        loadtest(f"{url}#{MODEL}", run, *FIT_WORKLOADS[name], "--seed", str(FIT_SEED + round_), "--warmup", "1",
                 log=run.with_suffix(".log"))
        steps += trace_lines(server_trace)[before:]
    return steps


def trace_lines(path: Path) -> list[str]:
    """A step trace's lines so far, its header first (none before the server wrote it)."""
    return path.read_text().splitlines(keepends=True) if path.exists() else []


def fit_profile(trace: Path, profile: Path) -> None:
    """``burstgate sim fit`` on ``trace``, as this machine's fits on served steps are made, to ``profile``: with
    compute efficiencies of their own for attention and for the steps the engine's fused step ran whole, where it
    has one."""
    with trace.open() as f:
        fused = json.loads(f.readline()).get("fused_rows")
    subprocess.run(burstgate("sim", "fit", "--from", str(trace), "--fit-overlap", "--fit-attention",
                             *["--fit-whole-steps"] * bool(fused),
                             "--name", profile.stem, "--out", str(profile)), check=True)


def workload_rounds(name: str, rounds: int, stored_in: Path | None = None) -> int:
    """Real runs of workload ``name`` for ``rounds`` (``ROUNDS_FACTOR``); replaying ``stored_in``, as many of
    those as it keeps (a folder kept before the factor has ``rounds``)."""
    wanted = rounds * ROUNDS_FACTOR.get(name, 1)
    if stored_in is None:
        return wanted
    kept = next((seed for seed in range(wanted) if not (stored_in / f"{name}-{seed}").is_dir()), wanted)
    return kept or wanted  # none kept: stored() says so by name


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
    ap.add_argument("--profile", action="append", default=[],
                    help="this machine's CPU profile (burstgate sim fit); repeat to compare several on the same real "
                         "runs (the first is the file's `fidelity`, after a --fit-profile); with --gpu, that GPU's "
                         "(e.g. h200)")
    ap.add_argument("--fit-trace", type=Path, metavar="FILE", help="fit this machine's profile in the same run: each "
                    "round first serves a share of served_steps.py's workloads, whose steps go to FILE (with "
                    "--fit-profile)")
    ap.add_argument("--fit-profile", type=Path, metavar="FILE", help="the profile fitted on --fit-trace's steps "
                    "(burstgate sim fit --fit-overlap), compared first")
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
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="real runs of each fidelity workload, times its ROUNDS_FACTOR (medians compared)")
    ap.add_argument("--runs", type=Path, metavar="DIR", help="keep the real runs in this folder (default: a new "
                                                             "temporary one, printed)")
    ap.add_argument("--replay", type=Path, metavar="DIR", help="simulate against the real runs a folder of --runs "
                                                               "keeps instead of running them (no server started)")
    ap.add_argument("--sim-seed", type=int, default=0, metavar="N", help="added to each round's seed of the "
                                                                         "simulator's step-spread draws")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    record = run_record()
    if (args.fit_trace is None) != (args.fit_profile is None):
        ap.error("--fit-trace and --fit-profile go together: the steps fitted on, and the profile fitted")
    if not args.profile and (args.gpu or args.fit_profile is None):
        ap.error("a profile to compare: --profile" + ("" if args.gpu else ", or --fit-trace and --fit-profile"))
    if args.gpu:
        record["gpu"] = {"real": str(args.gpu), "profile": args.profile[0],
                         "fidelity": gpu_fidelity(args.gpu, args.profile[0], args.gpu_served)}
        if args.save:
            args.save.write_text(json.dumps(record, indent=1) + "\n")
        return
    if args.replay and args.runs:
        ap.error("--replay reads the runs a folder keeps; --runs keeps new ones")
    if args.replay and args.fit_trace:
        ap.error("--replay simulates stored runs; fit on a run's trace with burstgate sim fit --from, then --profile")
    if args.fit_trace and "fidelity" in args.skip:
        ap.error("--fit-trace serves its steps among the fidelity runs: drop --skip fidelity")
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
        fit = (args.fit_trace, args.fit_profile) if args.fit_trace else None
        by_profile = fidelity(args.profile, args.workload or list(WORKLOADS), frontend_s, out, args.rounds, replay,
                              args.sim_seed, fit)
        record["profile"] = first = next(iter(by_profile))
        record["fidelity"] = by_profile[first]
        if len(by_profile) > 1:
            record["fidelity_by_profile"] = by_profile
    if "agreement" not in args.skip:
        record["agreement"] = {"replicas": args.replicas, "rate": args.rate, "requests": args.requests,
                               **agreement(args.replicas, args.rate, args.requests, frontend_s, out)}
    if args.save:
        args.save.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
