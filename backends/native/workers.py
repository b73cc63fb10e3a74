"""A model split over several ranks (tensor x pipeline parallel), driven by the engine's process (vLLM's
executor shape).

The engine's process is the driver: it schedules, samples, and runs the last pipeline stage's first rank
(parallel.py says why). For each step it posts the batch to every other rank (pickled, on the gloo group,
without waiting); each rank runs its shard of its stage, meets its tensor-parallel group in the all-reduces,
takes the previous stage's hidden states and sends its own to the next. With pipeline stages up to
``pipeline_parallel_size`` batches are in flight (``launch`` ... ``finish``, oldest first), so that every stage
has work while the last one finishes a step.

Where the other ranks run is the executor's (``distributed_executor_backend``): ``mp``, processes of this
machine (``ProcessWorkers``: spawned, fresh interpreters with no copied torch threads or CUDA state); ``ray``,
actors of a Ray cluster placed across its nodes (ray_workers.py). Either way a rank that dies makes the next
send, receive or collective fail on the driver (gloo sees the closed connection; NCCL's timeout bounds it),
so the step raises, its requests end with an error, and ``alive`` turns False for the deployment's health.
Nothing waits on a dead rank.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import socket
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from backends.native.batch import Batch
from backends.native.config import EngineConfig
from backends.native.model_runner import ModelRunner
from backends.native.parallel import Rank, check_parallel, stage_layers
from backends.native.process import prepare_process
from backends.native.weights import Checkpoint, open_checkpoint

log = logging.getLogger(__name__)

# The longest a rank waits for the others: to join, and in a collective (gloo fails at once when a peer
# dies; NCCL only notices at this timeout).
TIMEOUT_S = 600.0
_STOP = "stop"  # the message that ends a rank


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to start, passed whole to its process or actor."""

    rank: int
    config_json: str  # the EngineConfig, its pipeline partition resolved by the driver
    model_path: str
    max_model_len: int
    init_method: str  # where the ranks meet: tcp://driver-host:port
    device: str  # "cpu", or the CUDA device it runs on


class Workers(Protocol):
    """The ranks beyond the driver, wherever they run."""

    @property
    def driver_gpu(self) -> int | None:
        """The CUDA device the executor reserved for the driver, where it chooses one."""

    def dead(self) -> list[str]:
        """The names of the ranks that stopped."""

    def kill(self, index: int) -> None:
        """End the ``index``-th rank at once (tests: a rank lost mid-burst)."""

    def stop(self) -> None:
        """Wait for the ranks to end (after their stop message), ending those that do not."""


def run_rank(spec: RankSpec) -> None:
    """A worker rank: join, load this rank's part of the model, then run every step the driver posts, answer its
    queries, until it says stop."""
    config = EngineConfig.model_validate_json(spec.config_json)
    prepare_process(config, share=config.world_size)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    checkpoint = open_checkpoint(spec.model_path, config.hf_overrides)
    layers = stage_layers(checkpoint.config.num_layers, config.pipeline_parallel_size, config.pipeline_layer_partition)
    rank = Rank.join(spec.rank, config, layers, spec.init_method, device, TIMEOUT_S)
    runner = ModelRunner(config, checkpoint, spec.max_model_len, rank, device)
    while (message := rank.receive_object(rank.driver)) != _STOP:
        if isinstance(message, Batch):
            runner.execute(message)
        else:
            rank.post(getattr(runner, message)(), rank.driver)
    rank.stage.outbox.flush()
    rank.outbox.flush()
    rank.leave()


class ParallelRunner:
    """The driver's face of a model split over ranks, with ``ModelRunner``'s interface; ``launch`` and ``finish``
    keep up to ``depth`` batches in flight."""
    picks_tokens = False  # execute returns logits for the engine's sampler (a simulated runner: tokens)

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int) -> None:
        check_parallel(config, checkpoint.config)  # before any rank starts
        layers = stage_layers(checkpoint.config.num_layers, config.pipeline_parallel_size,
                              config.pipeline_layer_partition)
        config = config.model_copy(update={"pipeline_layer_partition": [len(stage) for stage in layers]})
        tp_size, world = config.tensor_parallel_size, config.world_size
        self.depth = config.pipeline_parallel_size
        driver = (config.pipeline_parallel_size - 1) * tp_size
        if config.distributed_executor_backend == "ray":
            from backends.native.ray_workers import RayWorkers, driver_host

            host = driver_host()
        else:
            host = "127.0.0.1"
        init_method = f"tcp://{host}:{_free_port(host)}"
        devices = [rank_device(config, r) for r in range(world)]
        specs = [RankSpec(r, config.model_dump_json(), str(checkpoint.path), max_model_len, init_method,
                          str(devices[r])) for r in range(world) if r != driver]
        self.workers: Workers = RayWorkers(specs, config) if config.distributed_executor_backend == "ray" \
            else ProcessWorkers(specs)
        if self.workers.driver_gpu is not None:
            devices[driver] = torch.device("cuda", self.workers.driver_gpu)
        try:
            self.rank = Rank.join(driver, config, layers, init_method, devices[driver], TIMEOUT_S)
            self.local = ModelRunner(config, checkpoint, max_model_len, self.rank, devices[driver])
        except BaseException:
            self.workers.stop()
            raise
        self._in_flight: deque[Batch] = deque()
        self._broken: str | None = None  # why no step can run any more: a step failed half-way through the ranks
        log.info("model parallel: %d ranks (tensor %d x pipeline %d, layers per stage %s) on %s", world, tp_size,
                 config.pipeline_parallel_size, config.pipeline_layer_partition, config.distributed_executor_backend)

    # --------------------------------------------------------------------- ModelRunner interface
    def __getattr__(self, name: str) -> Any:  # device, dtype, num_blocks, kernels, graphs, model ...
        return getattr(self.__dict__["local"], name)

    def launch(self, batch: Batch) -> None:
        """Start a step on every rank; its logits come from ``finish`` (steps finish in launch order)."""
        self._check_alive()
        with self._breaks_on_error():
            self.rank.post_all(batch, self._others())
        self._in_flight.append(batch)

    def finish(self) -> torch.Tensor:
        """The oldest launched step's logits, once the earlier stages' hidden states reach the driver's."""
        with self._breaks_on_error():
            return self.local.execute(self._in_flight.popleft())

    def execute(self, batch: Batch) -> torch.Tensor:
        self.launch(batch)
        return self.finish()

    def call(self, method: str) -> list[Any]:
        """Every rank's ``ModelRunner.<method>()`` in rank order (vLLM's collective_rpc, for queries); no step may
        be in flight."""
        assert not self._in_flight, "a query between launched steps"
        self._check_alive()
        self.rank.post_all(method, self._others())
        return [getattr(self.local, method)() if r == self.rank.rank else self.rank.receive_object(r)
                for r in range(self.rank.size)]

    @property
    def alive(self) -> bool:
        return self._broken is None and not self.workers.dead()

    def close(self) -> None:
        if self.alive:
            with contextlib.suppress(RuntimeError):  # a rank died meanwhile: stop() ends the others
                while self._in_flight:  # the stages before finish what they started, then hear stop
                    self.finish()
                self.rank.post_all(_STOP, self._others())
                self.rank.outbox.flush()
        self.workers.stop()
        self.rank.leave()

    def _others(self) -> list[int]:
        return [r for r in range(self.rank.size) if r != self.rank.rank]

    def _check_alive(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"the model's ranks are out of step since a failed step ({self._broken})")
        dead = self.workers.dead()
        if dead:
            raise RuntimeError(f"model-parallel rank(s) {', '.join(dead)} died")

    @contextlib.contextmanager
    def _breaks_on_error(self) -> Iterator[None]:
        """A step that fails part-way leaves the ranks out of step (a stage's hidden states unread): nothing may
        run after it, so the deployment reports unhealthy."""
        try:
            yield
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The engine's process (the driver) runs on the configured device, the r-th rank after it on the r-th CUDA
    device after that one (on Ray: the GPU Ray gives its actor); or every rank on the CPU."""
    device = config.torch_device()
    driver = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
    if device.type != "cuda" or rank == driver:
        return device
    if config.distributed_executor_backend == "ray":
        return torch.device("cuda", 0)
    index = (device.index or 0) + (rank - driver) % config.world_size
    if index >= torch.cuda.device_count():
        raise ValueError(f"{config.world_size} ranks (tensor x pipeline parallel) need CUDA devices "
                         f"{device.index or 0}..{(device.index or 0) + config.world_size - 1}; this machine has "
                         f"{torch.cuda.device_count()}")
    return torch.device("cuda", index)


class ProcessWorkers:
    """Ranks as processes of this machine (``distributed_executor_backend: mp``)."""

    driver_gpu = None  # the driver runs on the configured device

    def __init__(self, specs: list[RankSpec]) -> None:
        context = mp.get_context("spawn")  # a fresh interpreter: no copied torch threads or CUDA state
        self.processes = [context.Process(target=run_rank, args=(spec,), name=f"native-rank-{spec.rank}",
                                          daemon=True) for spec in specs]
        for process in self.processes:
            process.start()

    def dead(self) -> list[str]:
        return [p.name for p in self.processes if not p.is_alive()]

    def kill(self, index: int) -> None:
        self.processes[index].kill()

    def stop(self) -> None:
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
