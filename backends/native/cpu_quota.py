"""How many CPU threads the engine should run: the CPUs it may use, not the node's core count.

A container limited to 4 CPUs on a 64-core node still sees 64 cores; torch would start 64 threads and
the kernel would throttle them to 4 CPUs' worth of time, slower than 4 threads. The same holds for a
process pinned to some cores (``taskset``, a cpuset from Kubernetes' static CPU manager): two threads on
one allowed core wait for each other at every parallel region. So the count is the process's CPU
affinity, capped by the cgroup's quota: cgroup v2 (``cpu.max``: ``QUOTA PERIOD`` or ``max PERIOD``), else
cgroup v1 (``cpu.cfs_quota_us``, -1 for none, over ``cpu.cfs_period_us``), rounded up.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _quota(quota: str, period: str) -> int | None:
    """CPUs allowed by ``quota`` microseconds per ``period``; None when unlimited or unreadable."""
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    return math.ceil(q / p) if q > 0 and p > 0 else None


def cgroup_cpus(root: Path | None = None) -> int | None:
    """The CPU quota of this process's cgroup, in whole CPUs (rounded up); None when there is none."""
    root = root or CGROUP
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return _quota(quota, period or "100000")
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        v1_quota, v1_period = _read(v1 / "cpu.cfs_quota_us"), _read(v1 / "cpu.cfs_period_us")
        if v1_quota is not None and v1_period is not None:
            return _quota(v1_quota, v1_period)
    return None


def resolve_num_threads(num_threads: int | None, root: Path | None = None) -> tuple[int, str]:
    """The thread count to run with, and where it came from (for the engine's log line)."""
    root = root or CGROUP
    if num_threads:
        return num_threads, "num_threads"
    cores = usable_cores()
    cpus = cgroup_cpus(root)
    if cpus is not None and cpus < cores:
        return cpus, f"the cgroup's CPU quota under {root}"
    return cores, "the process's CPU affinity"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), where the OS tells; else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
