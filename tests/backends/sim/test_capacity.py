"""`burstgate plan --slo`: the fewest replicas whose simulated fleet meets every SLO (backends/sim/capacity.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from backends.native.config import EngineConfig
from backends.sim.capacity import fewest_replicas, parse_slo, plan_fleet
from backends.sim.virtual import burst_workload
from gateway.cli import app
from gateway.routing.round_robin import RoundRobinConfig
from loadtest.schedule import Schedule, arrival_offsets
from tests.backends.sim.profiles import constant_step_profile

DESIGN = "configs/llama-12.3b-gqa.json"


def test_the_answer_is_the_one_known_by_construction(tmp_path):
    """Every step takes 0.1 s and a replica runs one sequence at a time, so it answers 10 one-token requests a
    second. At a steady 35 a second, taken in turn, 3 replicas fall behind (each gets one every 86 ms) and 4 keep
    up (one every 114 ms: TTFT exactly one step)."""
    profile = str(constant_step_profile(tmp_path))
    engine = EngineConfig(model_path=DESIGN, max_num_seqs=1)

    requests = burst_workload(200, 32, 1, arrival_offsets(Schedule.constant, 200, rate=35.0))
    result = plan_fleet(engine, profile, requests, {"p99_ttft_ms": 150.0}, RoundRobinConfig(), max_replicas=16,
                        tensor_parallel_size=1)
    assert result.replicas == 4 and result.gpus == 4
    by_size = {p.replicas: p for p in result.curve}
    assert not by_size[3].meets and by_size[4].meets
    assert by_size[4].summary["p99_ttft_ms"] == pytest.approx(100.0)
    assert [p.replicas for p in result.curve] == [1, 2, 3, 4]  # doubled to 4, then bisected between 2 and 4


def test_the_search_doubles_then_bisects_and_gives_up_past_the_limit():
    runs = []

    def run(n):
        runs.append(n)
        return {"failed": 0, "p99_ttft_ms": 1000 / n}

    assert fewest_replicas(run, {"p99_ttft_ms": 100.0}, 64)[0] == 10
    assert runs == [1, 2, 4, 8, 16, 12, 10, 9]
    assert fewest_replicas(run, {"p99_ttft_ms": 1.0}, 8)[0] is None


def test_a_run_with_failed_requests_never_meets_the_slo():
    assert fewest_replicas(lambda n: {"failed": 1, "p99_ttft_ms": 1.0}, {"p99_ttft_ms": 100.0}, 2)[0] is None


@pytest.mark.parametrize("text, parsed", [("ttft_p99_ms=2000", ("p99_ttft_ms", 2000.0)),
                                          ("tpot_p50_ms=50", ("median_tpot_ms", 50.0)),
                                          ("e2el_mean_ms=1.5", ("mean_e2el_ms", 1.5))])
def test_slos_name_a_metric_and_a_statistic(text, parsed):
    assert parse_slo(text) == parsed


@pytest.mark.parametrize("text", ["ttft=2000", "ttft_p99_ms", "ttft_p42_ms=1", "ttft_p99_ms=fast", "ttft_p99_ms=0"])
def test_bad_slos_are_refused(text):
    with pytest.raises(ValueError, match="SLO"):
        parse_slo(text)


def test_plan_with_an_slo_answers_per_gpu_type_with_its_curve(tmp_path):
    chart = tmp_path / "plan.png"
    result = CliRunner().invoke(app, ["plan", "--model", DESIGN, "--gpu", "h100", "--gpu", "a100-80g", "--slo",
                                      "tpot_p99_ms=40", "--rate", "10", "--requests", "200", "--json", "--plot",
                                      str(chart)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output)
    plans = {p["gpu"]: p for p in answer["plans"]}
    assert plans["h100"]["tensor_parallel_size"] == 1 and plans["h100"]["replicas"] >= 1
    assert plans["a100-80g"]["replicas"] >= plans["h100"]["replicas"]  # a slower GPU never needs fewer
    for plan in plans.values():
        chosen = next(p for p in plan["curve"] if p["replicas"] == plan["replicas"])
        assert chosen["meets"] and chosen["p99_tpot_ms"] <= 40
        assert all(not p["meets"] for p in plan["curve"] if p["replicas"] < plan["replicas"])
    assert chart.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["--slo", "tpot_p99_ms=40"], "give its --rate"),
    (["--slo", "speed=1", "--rate", "1"], "METRIC_STAT_ms=LIMIT"),
])
def test_plan_with_an_slo_refuses_what_it_cannot_answer(args, message):
    result = CliRunner().invoke(app, ["plan", "--model", DESIGN, "--gpu", "h100", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_every_tensor_parallel_size_is_tried_and_the_fewest_gpus_win(tmp_path):
    """On the constant-step profile a replica's speed does not grow with its GPUs, so splitting it only costs GPUs:
    TP 1 wins with 4; TP 2 and TP 4, tried with at most those 4 GPUs (2 replicas, 1), miss."""
    profile = str(constant_step_profile(tmp_path))
    engine = EngineConfig(model_path=DESIGN, max_num_seqs=1)
    requests = burst_workload(200, 32, 1, arrival_offsets(Schedule.constant, 200, rate=35.0))
    result = plan_fleet(engine, profile, requests, {"p99_ttft_ms": 150.0}, RoundRobinConfig(), max_replicas=16,
                        max_tensor_parallel_size=4)
    assert (result.tensor_parallel_size, result.replicas, result.gpus) == (1, 4, 4)
    assert [o.tensor_parallel_size for o in result.others] == [2, 4]
    for other, most in zip(result.others, (2, 1)):
        assert other.replicas is None and "more GPUs than TP 1's 4" in other.why
        assert max(p.replicas for p in other.curve) == most

