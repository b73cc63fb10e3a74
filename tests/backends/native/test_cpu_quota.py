"""The engine's thread count defaults to the container's CPU quota (cgroup v2, then v1), read from fake
cgroup trees here; an explicit ``num_threads`` wins."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from backends.native import cpu_quota
from backends.native.config import EngineConfig
from backends.native.cpu_quota import cgroup_cpus, resolve_num_threads
from backends.native.process import prepare_process


@pytest.mark.parametrize("cpu_max, cpus", [("200000 100000", 2), ("150000 100000", 2), ("50000 100000", 1),
                                           ("max 100000", None), ("100000", 1)])
def test_cgroup_v2_quota_rounded_up(tmp_path, cpu_max, cpus):
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    assert cgroup_cpus(tmp_path) == cpus


@pytest.mark.parametrize("folder", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_quota(tmp_path, folder):
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / folder / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpus(tmp_path) is None
    (tmp_path / folder / "cpu.cfs_quota_us").write_text("250000\n")
    assert cgroup_cpus(tmp_path) == 3


def test_explicit_threads_then_quota_then_affinity(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert resolve_num_threads(None, tmp_path) == (64, "the process's CPU affinity")
    (tmp_path / "cpu.max").write_text("400000 100000")
    assert resolve_num_threads(None, tmp_path)[0] == 4
    assert resolve_num_threads(7, tmp_path) == (7, "num_threads")
    (tmp_path / "cpu.max").write_text("12800000 100000")  # a quota above the machine's cores
    assert resolve_num_threads(None, tmp_path)[0] == 64


def test_a_process_pinned_to_some_cores_runs_one_thread_per_allowed_core(tmp_path):
    """``taskset -c 1`` (or a Kubernetes cpuset): the affinity mask, not the node's cores, counts."""
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this OS")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert resolve_num_threads(None, tmp_path) == (1, "the process's CPU affinity")
    finally:
        os.sched_setaffinity(0, before)


def test_the_process_takes_the_quota_when_prepared_for_an_engine(tmp_path, monkeypatch, caplog):
    """Resolved when the process is prepared (process.prepare_process, before an engine starts), not when the
    config is read: the config keeps None."""
    (tmp_path / "cpu.max").write_text("100000 100000")
    monkeypatch.setattr(cpu_quota, "CGROUP", tmp_path)
    config = EngineConfig(device="cpu")
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="backends.native.process"):
            settings = prepare_process(config)
        assert torch.get_num_threads() == settings.threads == 1 and config.num_threads is None
        assert f"1 CPU threads (the cgroup's CPU quota under {tmp_path})" in caplog.text
        assert prepare_process(config, share=2).threads == 1  # never below one
        assert prepare_process(EngineConfig(device="cpu", num_threads=3), share=2).threads == 3  # given: as given
    finally:
        torch.set_num_threads(before)
