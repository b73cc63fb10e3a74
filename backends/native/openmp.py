"""Give back a thread's OpenMP worker threads, so that the thread stepping the engine owns the only team.

libgomp keeps a pool of worker threads for every thread that has run a parallel region, for as long as
that thread lives. Once it manages more threads than the CPUs it may use, it barely spins at barriers
(its "throttled" spin count), so the threads of every parallel region sleep in the kernel and are woken
for the next one: hundreds of times per engine step. The engine is built and warmed up in one thread and
stepped in another (async_engine.py); with the builder's pool parked, a burst ran far slower, the stepping
thread switching context at every region. ``omp_pause_resource_all`` (OpenMP 5.0; libgomp, LLVM's libomp and Intel's libiomp5 have it) ends
the calling thread's pool; a later parallel region in that thread starts a new one.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads end, data may stay
RUNTIME = re.compile(r"^lib(gomp|omp|iomp5)\b.*\.so")


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime loaded in this process (torch's), found among its mapped files."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return None
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) >= 6 and RUNTIME.match(Path(fields[5]).name):
            try:
                return ctypes.CDLL(fields[5])  # already loaded: the same library, not a second copy
            except OSError:
                continue
    return None


def release_thread_pool() -> bool:
    """End the calling thread's OpenMP worker threads (outside a parallel region); False where no runtime
    with ``omp_pause_resource_all`` is loaded or it refuses."""
    runtime = _runtime()
    pause = getattr(runtime, "omp_pause_resource_all", None)
    if pause is None:
        log.debug("no OpenMP runtime with omp_pause_resource_all: the building thread keeps its threads")
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0
