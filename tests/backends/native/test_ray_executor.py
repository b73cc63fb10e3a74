"""The Ray executor: `burstgate serve` on the head node of a Ray cluster serves a model split over its nodes.

The test starts a cluster of two nodes on this machine, as ops start one across machines (`ray start --head`,
then `ray start --address` on the other node; 2 CPUs each), and serves a tiny Llama split 2 tensor x 2 pipeline
ways with `distributed_executor_backend: ray`: the engine's process joins the cluster as its driver and three
rank actors run in a placement group across both nodes. Completions through the gateway are the tokens one
process gives; an actor killed mid-burst (its process, as a lost node would) fails every request in flight and
the deployment's health, never a hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine
from tests.backends.native.splits import assert_losing_a_rank_fails_requests_and_health
from tests.servers import burstgate_serve, free_port

RAY = Path(sys.executable).parent / "ray"
PROMPTS = ["Hello there", "The quick brown fox", "1 2 3 4", "Paris is", "def f(x):", "Once upon a time"]


@pytest.fixture(scope="module")
def ray_cluster():
    """The address of a two-node Ray cluster on this machine (stopped afterwards)."""
    port = free_port()
    common = ["--num-cpus", "2", "--disable-usage-stats"]
    subprocess.run([RAY, "start", "--head", "--port", str(port), "--include-dashboard", "false", *common], check=True,
                   capture_output=True)
    try:
        subprocess.run([RAY, "start", "--address", f"127.0.0.1:{port}", *common], check=True, capture_output=True)
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True)


@pytest.fixture(scope="module")
def split_over_ray(ray_cluster, tiny_llama, tmp_path_factory):
    config = tmp_path_factory.mktemp("ray") / "burstgate.yaml"
    config.write_text(f"""
resilience: {{health_interval_s: 0.2}}
models:
  - name: tiny
    deployments:
      - kind: native
        model_path: {tiny_llama}
        dtype: float32
        num_blocks: 64
        tensor_parallel_size: 2
        pipeline_parallel_size: 2
        distributed_executor_backend: ray
""")
    with burstgate_serve("--config", str(config), env={"RAY_ADDRESS": ray_cluster}) as served:
        yield served


def _rank_actors() -> list[int]:
    """Process ids of the rank actors running a model's steps on this machine."""
    out = subprocess.run(["pgrep", "-f", "ray::RankActor.run"], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def _nodes_of(pids: list[int]) -> set[str]:
    """The Ray nodes (raylet process ids) these worker processes belong to."""
    return {Path(f"/proc/{pid}/stat").read_text().split()[3] for pid in pids}


def test_a_model_split_over_two_ray_nodes_serves_the_tokens_of_one_process(split_over_ray, tiny_llama,
                                                                          smollm2_tokenizer):
    actors = _rank_actors()
    assert len(actors) == 3 and len(_nodes_of(actors)) == 2  # three ranks beside the driver, on both nodes
    engine = LLMEngine(EngineConfig(model_path=str(tiny_llama), dtype="float32", num_blocks=64, num_threads=1),
                       tokenizer=smollm2_tokenizer)
    expected = engine.generate([smollm2_tokenizer.encode(p) for p in PROMPTS],
                               SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    served = httpx.post(f"{split_over_ray.url}/v1/completions", json=body, timeout=120).json()
    assert [c["text"] for c in sorted(served["choices"], key=lambda c: c["index"])] == [e.text for e in expected]


def test_a_rank_whose_run_fails_ends_its_actor_process_as_a_lost_node_would(ray_cluster):
    # A Ray actor outlives a failed call by default; a rank that did would keep its sockets open, and the driver,
    # waiting on it behind a peer that failed (a tensor-parallel partner of the killed rank), would hang.
    script = """
import sys, ray
from backends.native.ray_workers import RankActor
from backends.native.workers import RankSpec
ray.init(address=sys.argv[1], log_to_driver=False)
actor = ray.remote(num_cpus=0)(RankActor).remote()  # (the served split holds every CPU)
try:
    ray.get(actor.run.remote(RankSpec(1, "{not a config", "nowhere", 16, "tcp://127.0.0.1:1", "cpu")))
except ray.exceptions.RayActorError:
    sys.exit(0)  # the actor ended
except ray.exceptions.RayTaskError:
    sys.exit(3)  # the call failed and the actor lives on
"""
    # (told by the exit status: Ray's own lines share the script's stdout)
    out = subprocess.run([sys.executable, "-c", script, ray_cluster], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])


def test_a_rank_actor_killed_mid_burst_fails_its_requests_and_the_deployment(split_over_ray):
    def kill_an_actor() -> None:
        os.kill(_rank_actors()[0], signal.SIGKILL)

    assert_losing_a_rank_fails_requests_and_health(split_over_ray.url, "tiny", kill_an_actor)
    time.sleep(0.5)
    assert split_over_ray.proc.poll() is None  # the gateway itself serves on, reporting the deployment down
