"""The thread that steps the engine owns the process's only OpenMP team: the thread that built the engine
gives its worker threads back, so steps run in another thread (as AsyncEngine runs them) keep libgomp
spinning at barriers instead of sleeping and waking its threads at every parallel region."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = """
import json, threading, torch
from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine

torch.set_num_threads(2)
engine = LLMEngine(EngineConfig(load_format="dummy", dtype="float32", num_threads=2))  # built (and warmed) here
for i in range(8):
    engine.add_request(f"r{i}", list(range(100 + i, 132 + i)), SamplingParams(max_tokens=24, ignore_eos=True))
result = {}

def step_all():
    def switches():
        status = open(f"/proc/self/task/{threading.get_native_id()}/status").read()
        return int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    engine.step()  # the first step starts this thread's team
    before, steps = switches(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    result.update(steps=steps, switches=switches() - before)

worker = threading.Thread(target=step_all)
worker.start()
worker.join()
print(json.dumps(result))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_steps_in_another_thread_do_not_sleep_at_every_parallel_region():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # ~30 layers x several parallel regions per step: with the builder's team parked, each region's
    # threads slept and woke (hundreds of switches per step); with one team, a few per step at most.
    assert result["switches"] < 10 * result["steps"], result
