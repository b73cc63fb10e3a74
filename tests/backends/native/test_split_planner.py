"""``burstgate plan --gpus N``: how to split a model over N GPUs (tensor x pipeline parallel x replicas), chosen
per interconnect, and checked against the seed study (arXiv 2311.03687): on its 8 x RTX 4090 server (PCIe,
peer-to-peer disabled) the 1,000-prompt burst took about 120 s for Llama2-7B and 1,600 s for Llama2-70B, 13x,
"not seen on the A800" (NVLink)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from backends.native.config import ModelConfig
from backends.native.gpus import INTERCONNECTS
from backends.native.split_planner import Layout, SplitPlan, plan_split
from gateway.cli import app

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
STUDY_RATIO = 1600 / 120  # the seed study's 70B / 7B burst time on 8 x RTX 4090


def _model(name: str) -> ModelConfig:
    return ModelConfig.from_hf_file(CONFIGS / f"{name}.json")


def _layout(plan: SplitPlan, tp: int, pp: int) -> Layout:
    return next(l for l in plan.layouts if (l.tensor_parallel_size, l.pipeline_parallel_size) == (tp, pp))


def test_a_ring_all_reduce_and_a_send_cost_their_link_time():
    link = INTERCONNECTS["pcie4-no-p2p"]  # 16 GB/s a direction, 30 us an operation
    assert link.all_reduce_s(1e6, 8) == pytest.approx(30e-6 + 2 * 7 / 8 * 1e6 / 16e9)
    assert link.all_reduce_s(1e6, 1) == 0
    assert link.send_s(1e6) == pytest.approx(30e-6 + 1e6 / 16e9)
    assert link.gather_s(1e6, 8) == pytest.approx(30e-6 + 7 * 1e6 / 16e9)  # 7 ranks' slices into one link


def test_the_seed_studys_13x_between_llama2_70b_and_7b_on_rtx4090s_without_p2p():
    # As the study served them: 7B whole on each GPU (8 replicas), 70B split over all 8 by tensor parallelism.
    ratios = {}
    for gpu in ("rtx4090", "a800-80g"):
        seven = _layout(plan_split(_model("llama-2-7b"), gpu, 8), 1, 1)
        seventy = _layout(plan_split(_model("llama-2-70b"), gpu, 8), 8, 1)
        assert seven.replicas == 8 and seventy.replicas == 1
        ratios[gpu] = seventy.burst_s / seven.burst_s
    assert abs(ratios["rtx4090"] / STUDY_RATIO - 1) < 0.30  # lands at 14.0x
    assert ratios["a800-80g"] < 0.7 * ratios["rtx4090"]  # NVLink: the gap the study did not see there


def test_without_p2p_pipeline_stages_beat_tensor_parallelism_and_with_nvlink_tensor_parallelism_wins():
    seventy = _model("llama-2-70b")
    pcie = plan_split(seventy, "rtx4090", 8)
    assert pcie.interconnect == "pcie4-no-p2p"  # the type's own link
    assert pcie.best.pipeline_parallel_size > 1
    tp8 = _layout(pcie, 8, 1)
    assert tp8.all_reduce_s > 0.5 * tp8.burst_s  # all-reduces over PCIe through host memory dominate
    assert pcie.best.burst_s < 0.6 * tp8.burst_s
    assert "all-reduce" in pcie.reason and "TP 8 x PP 1 x 1" in pcie.reason
    nvlink = plan_split(seventy, "rtx4090", 8, interconnect="nvlink4")
    assert (nvlink.best.tensor_parallel_size, nvlink.best.pipeline_parallel_size) == (8, 1)
    pp8 = _layout(nvlink, 1, 8)
    assert pp8.bubble_s > 0 and pp8.send_s > 0 and pp8.all_reduce_s == 0


def test_the_design_model_on_six_h100s_runs_as_six_replicas_not_the_training_split():
    plan = plan_split(_model("llama-12.3b-gqa"), "h100", 6)
    assert all(l.fits for l in plan.layouts)
    assert (plan.best.tensor_parallel_size, plan.best.pipeline_parallel_size, plan.best.replicas) == (1, 1, 6)
    assert _layout(plan, 1, 6).burst_s > 1.5 * plan.best.burst_s  # seed 000's PP 6: one replica, batches in a pipe


def test_a_replica_larger_than_a_node_spans_nodes_over_the_network():
    plan = plan_split(_model("llama-2-70b"), "h100", 16, gpus_per_node=8)
    assert _layout(plan, 8, 2).nodes_per_replica == 2 and _layout(plan, 4, 2).nodes_per_replica == 1
    slow_network = plan_split(_model("llama-2-70b"), "h100", 16, gpus_per_node=8, network="eth-100g")
    assert _layout(slow_network, 8, 2).send_s > _layout(plan, 8, 2).send_s


def test_a_layout_whose_weights_do_not_fit_says_so():
    plan = plan_split(_model("llama-2-70b"), "rtx4090", 8)
    whole = _layout(plan, 1, 1)
    assert not whole.fits and "no room" in whole.why and plan.layouts[-1].fits is False


def test_plan_gpus_prints_every_layout_and_its_recommendation():
    result = CliRunner().invoke(app, ["plan", "--model", str(CONFIGS / "llama-2-70b.json"), "--gpu", "rtx4090",
                                      "--gpus", "8", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["interconnect"] == "pcie4-no-p2p" and len(plan["layouts"]) == 10
    assert plan["reason"].startswith(plan["layouts"][0]["name"])
    table = CliRunner().invoke(app, ["plan", "--model", str(CONFIGS / "llama-2-70b.json"), "--gpu", "a800-80g",
                                     "--gpus", "8", "--interconnect", "pcie4"])
    assert table.exit_code == 0 and "PCIe 4.0 x16" in table.output and "recommended:" in table.output
    bad = CliRunner().invoke(app, ["plan", "--model", str(CONFIGS / "llama-2-70b.json"), "--gpu", "h100",
                                   "--gpus", "8", "--interconnect", "carrier-pigeon"])
    assert bad.exit_code == 2 and "carrier-pigeon" in bad.output
