"""What the native engine changes for its whole process, in one named start-up step (``prepare_process``) that
whoever starts an engine calls first: torch's CPU threads, sized to the CPUs this process may use
(cpu_quota.py), and on CPU the C library told to keep freed heap memory (host_memory.py). Engine and runner
constructors change nothing beyond themselves."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from backends.native.config import EngineConfig
from backends.native.cpu_quota import resolve_num_threads
from backends.native.host_memory import keep_freed_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessSettings:
    """What ``prepare_process`` set."""

    threads: int
    threads_source: str
    keeps_freed_memory: bool


def prepare_process(config: EngineConfig, share: int = 1) -> ProcessSettings:
    """Set torch's CPU threads to ``config.num_threads``, else to the CPUs this process may use divided among
    ``share`` processes (tensor-parallel ranks on one machine); on a CPU engine, keep freed heap memory in the
    process so that each step's activations reuse it instead of faulting in fresh pages."""
    threads, source = resolve_num_threads(config.num_threads)
    if config.num_threads is None and share > 1:
        threads, source = max(1, threads // share), f"{source}, shared by {share} processes"
    torch.set_num_threads(threads)
    kept = config.torch_device().type == "cpu" and keep_freed_memory()
    log.info("native engine process: %d CPU threads (%s)%s", threads, source,
             ", freed memory kept" if kept else "")
    return ProcessSettings(threads, source, kept)
