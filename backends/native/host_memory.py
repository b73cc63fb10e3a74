"""The host's memory as the engine sees it: what it may still take (``available_memory``: the machine's
available memory, capped by the container's cgroup limit), and freed tensor memory that stays in the
process (``keep_freed_memory``), so a CPU step's activations do not fault in fresh pages.

glibc serves allocations above its mmap threshold (128 KiB at start, raised by frees up to 32 MiB) with
mmap and unmaps them on free, and gives the top of the heap back to the kernel once more than twice that
threshold is free. A CPU step allocates and frees its activations layer by layer (tens of MiB per layer
in a 2048-token prefill), so how much of them came back as fresh pages, faulted in and zeroed by the
kernel, depended on what the process had freed before, and a step's time with it. vLLM's CPU build asks for tcmalloc (LD_PRELOAD) for the same reason; here glibc is told at
start-up through mallopt, with nothing to install. The cost: the process keeps its peak heap.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD_MAX = 32 << 20  # the most glibc accepts on 64-bit: larger blocks are always mapped
NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse (blocks up to 32 MiB from the heap, the heap never
    trimmed); False where the C library has no mallopt (not glibc) or refuses."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library, already loaded
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    kept = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1
    if not kept:
        log.info("the C library does not take mallopt: freed step memory may be faulted in again")
    return kept


CGROUP = Path("/sys/fs/cgroup")


def available_memory(root: Path | None = None) -> int:
    """Bytes this process may still allocate: the machine's available memory, or less where its cgroup's limit
    (a container's; v2 ``memory.max`` less ``memory.current``, else v1's ``memory.limit_in_bytes`` less
    ``memory.usage_in_bytes``) leaves less. A pod limited to 8 GiB on a 256 GiB node sees the node's memory
    in ``psutil``, and would be killed for taking it."""
    root = root or CGROUP
    available = psutil.virtual_memory().available
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            left = int((root / limit).read_text()) - int((root / usage).read_text())
        except (OSError, ValueError):  # not this cgroup version, or "max": no limit
            continue
        return max(min(available, left), 0)
    return available
