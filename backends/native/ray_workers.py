"""Ranks as actors of a Ray cluster (``distributed_executor_backend: ray``, vLLM's name), so that a model can
span several machines.

The engine's process joins the cluster as a driver (``ray.init``: the cluster named by ``RAY_ADDRESS``, as
Ray's own tools read it, else a local one), reserves one bundle per rank in a placement group (a GPU, or a CPU,
each; PACK: as few nodes as hold them, as vLLM does; the driver's own bundle on its node, its GPU the one Ray gives
a placeholder actor there), and starts one actor per other rank in a bundle: the driver's stage's ranks on the
driver's node first, then each earlier stage's, node by node, so that a tensor-parallel group shares a node
wherever the nodes' sizes allow and only stage-to-stage sends cross between nodes. The actors run ``workers.run_rank``: from there on they are ranks like any, meeting
the driver's process group at its node's address. A dead actor ends its ``run`` call, which is how the driver
sees it (``dead``). A rank whose ``run`` fails ends its actor's process, as a rank process of the ``mp`` executor
does: a Ray actor outlives its failed calls by default, and its open sockets would leave the driver waiting on a
rank that will never send (the driver's peers notice only a closed connection at once).
"""

from __future__ import annotations

import logging
import os

from backends.native.config import EngineConfig
from backends.native.workers import RankSpec, run_rank

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0  # the longest the placement group may wait for the cluster's resources


def driver_host() -> str:
    """This node's address in the Ray cluster (joined on first call), where the other ranks meet the driver."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level=logging.WARNING, log_to_driver=False)
    return ray.util.get_node_ip_address()


class RankActor:
    """One rank in a Ray worker process (or the placeholder holding the driver's GPU)."""

    def gpu_ids(self) -> list[int]:
        import ray

        return [int(i) for i in ray.get_gpu_ids()]

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, spec: RankSpec) -> None:
        try:
            run_rank(spec)
        except BaseException:
            log.exception("native rank %d failed; ending its actor", spec.rank)
            logging.shutdown()
            os._exit(1)


class RayWorkers:
    """The ranks beyond the driver as Ray actors, one per bundle of a placement group."""

    def __init__(self, specs: list[RankSpec], config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = config.torch_device().type == "cuda"
        resource = {"GPU": 1} if gpu else {"CPU": 1}
        here = f"node:{driver_host()}"
        self.group = placement_group([{**resource, here: 0.001}] + [resource] * len(specs), strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=READY_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self.group)
            raise RuntimeError(f"the Ray cluster has no room for {len(specs) + 1} ranks of {resource} each "
                               f"(available: {ray.available_resources()})")
        actor = ray.remote(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0)(RankActor)

        def in_bundle(index: int):
            return actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=index)).remote()

        self.placeholder = in_bundle(0) if gpu else None
        # the GPU of the driver's bundle, which the engine's process runs on (None on CPU)
        self.driver_gpu = None if self.placeholder is None else ray.get(self.placeholder.gpu_ids.remote())[0]
        nodes = ray.util.placement_group_table(self.group)["bundles_to_node_id"]
        bundles = sorted(range(1, len(specs) + 1), key=lambda b: (nodes[b] != nodes[0], nodes[b]))
        tp = config.tensor_parallel_size
        specs = sorted(specs, key=lambda s: (-(s.rank // tp), s.rank))  # the driver's stage first, then earlier ones
        self.actors = [in_bundle(b) for b in bundles]
        self.names = [f"native-rank-{spec.rank}" for spec in specs]
        self.nodes = ray.get([a.node_id.remote() for a in self.actors])  # the Ray node of each rank, as in names
        self.runs = [a.run.remote(spec) for a, spec in zip(self.actors, specs)]

    def dead(self) -> list[str]:
        import ray

        ended, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        return [name for name, run in zip(self.names, self.runs) if run in ended]

    def kill(self, index: int) -> None:
        import ray

        ray.kill(self.actors[index])

    def stop(self) -> None:
        import ray

        ray.wait(self.runs, num_returns=len(self.runs), timeout=10)
        for actor in [*self.actors, *([self.placeholder] if self.placeholder else [])]:
            ray.kill(actor)
        ray.util.remove_placement_group(self.group)
