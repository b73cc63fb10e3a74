"""Tensor-parallel execution: one worker process per extra rank, driven by rank 0 (vLLM's multiprocess
executor shape).

Rank 0 is the engine's own process: it schedules, samples and holds its shard like any rank. Before each
step it broadcasts the step's ``Batch`` to the workers (on the gloo group); every rank runs its shard
and meets the others in the model's all-reduces; the logits are gathered on rank 0. Workers are
started here and watched: a worker that dies makes the next collective fail on rank 0 (gloo sees the
closed connection; NCCL's timeout bounds it), so the step raises, its requests end with an error, and
``alive`` turns False for the deployment's health. Nothing waits on a dead worker.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import socket
from typing import Any

import torch

from backends.native.batch import Batch
from backends.native.config import EngineConfig
from backends.native.model_runner import ModelRunner
from backends.native.parallel import TensorParallel, check_tensor_parallel
from backends.native.process import prepare_process
from backends.native.weights import Checkpoint, open_checkpoint

log = logging.getLogger(__name__)

# The longest a rank waits for the others: to join, and in a collective (gloo fails at once when a peer
# dies; NCCL only notices at this timeout).
TIMEOUT_S = 600.0
_STOP = "stop"  # the broadcast that ends a worker


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r runs on the r-th CUDA device after the configured one, or on the CPU."""
    device = config.torch_device()
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} needs CUDA devices {device.index or 0}.."
                         f"{(device.index or 0) + config.tensor_parallel_size - 1}; this machine has "
                         f"{torch.cuda.device_count()}")
    return torch.device("cuda", index)


class ParallelRunner:
    """Rank 0's face of a tensor-parallel model, with the same interface as ``ModelRunner``."""
    picks_tokens = False  # execute returns logits for the engine's sampler (a simulated runner: tokens)


    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int) -> None:
        size = config.tensor_parallel_size
        check_tensor_parallel(checkpoint.config, size)  # before any process starts
        devices = [rank_device(config, r) for r in range(size)]
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.get_context("spawn")  # a fresh interpreter: no copied torch threads or CUDA state
        self.workers = [context.Process(target=_worker_main, name=f"native-tp-rank-{rank}", daemon=True,
                                        args=(rank, size, config.model_dump_json(), str(checkpoint.path),
                                              max_model_len, init_method, str(devices[rank])))
                        for rank in range(1, size)]
        for worker in self.workers:
            worker.start()
        try:
            self.tp = TensorParallel.join(0, size, init_method, devices[0], TIMEOUT_S)
            self.local = ModelRunner(config, checkpoint, max_model_len, self.tp, devices[0])
        except BaseException:
            self._stop_workers()
            raise
        log.info("tensor parallel: %d ranks on %s", size, ", ".join(map(str, devices)))

    # --------------------------------------------------------------------- ModelRunner interface
    def __getattr__(self, name: str) -> Any:  # device, dtype, num_blocks, kernels, graphs, model ...
        return getattr(self.__dict__["local"], name)

    def execute(self, batch: Batch) -> torch.Tensor:
        self._check_alive()
        self.tp.broadcast(batch)
        return self.local.execute(batch)

    def call(self, method: str) -> list[Any]:
        """Every rank's ``ModelRunner.<method>()`` in rank order (vLLM's collective_rpc, for queries)."""
        self._check_alive()
        self.tp.broadcast(method)
        return self.tp.gather_objects(getattr(self.local, method)())

    @property
    def alive(self) -> bool:
        return all(w.is_alive() for w in self.workers)

    def close(self) -> None:
        if self.alive:
            with contextlib.suppress(RuntimeError):  # a rank died meanwhile: the joins below end the others
                self.tp.broadcast(_STOP)
        self._stop_workers()
        self.tp.leave()

    def _check_alive(self) -> None:
        dead = [w.name for w in self.workers if not w.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) {', '.join(dead)} died")

    def _stop_workers(self) -> None:
        for worker in self.workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=10)


def _worker_main(rank: int, size: int, config_json: str, model_path: str, max_model_len: int, init_method: str,
                 device: str) -> None:
    """A worker: join the group, load this rank's shard, then run every broadcast step until told to stop."""
    config = EngineConfig.model_validate_json(config_json)
    prepare_process(config, share=size)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = TensorParallel.join(rank, size, init_method, device, TIMEOUT_S)
    checkpoint = open_checkpoint(model_path, config.hf_overrides)
    runner = ModelRunner(config, checkpoint, max_model_len, tp, device)
    while True:
        message = tp.broadcast()
        if message == _STOP:
            break
        if isinstance(message, Batch):
            runner.execute(message)
        else:
            tp.gather_objects(getattr(runner, message)())
    tp.leave()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
