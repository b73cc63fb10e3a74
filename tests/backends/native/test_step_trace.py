"""The step trace: every step the engine runs, with its batch and its share of the engine's time line, written
while it serves, read back as the steps a simulator profile is fitted on."""

from __future__ import annotations

import gzip
import json

import pytest
from typer.testing import CliRunner

from backends.base import SamplingParams
from backends.native.batch import Batch
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine
from backends.native.fused_step import fused_rows
from backends.native.step_trace import StepTrace, load_trace
from gateway.cli import app


def _batch(query_lens: list[int], context_lens: list[int]) -> Batch:
    return Batch([], [], [], query_lens, context_lens, [], [True] * len(query_lens))


def _steps(path) -> list[list]:
    return load_trace(path)["steps"]


def test_a_step_lasts_from_the_end_of_the_one_before_and_the_first_after_idle_from_its_start(tmp_path):
    trace = StepTrace(tmp_path / "t.jsonl", {"model": "m", "block_size": 64})  # the host's clock: marks are seconds
    trace.launched(_batch([5, 7], [5, 7]), start=1.0, done=1.3)
    trace.called(in_flight=False, more=True)
    trace.launched(_batch([1, 1], [6, 8]), start=1.5, done=1.6)  # 0.2 s of host work before it: its share
    trace.called(in_flight=False, more=False)  # then the engine idles
    trace.launched(_batch([1], [9]), start=5.0, done=5.05)
    trace.called(in_flight=False, more=False)
    trace.close()
    assert _steps(tmp_path / "t.jsonl") == [[[5, 7], [5, 7], 2, pytest.approx(0.3), 0, 0],
                                            [[1, 1], [6, 8], 2, pytest.approx(0.3), 0, 0],
                                            [[1], [9], 1, pytest.approx(0.05), 0, 0]]


def test_a_step_launched_ahead_is_written_once_finished_and_ends_on_the_devices_clock(tmp_path):
    # async scheduling on a GPU: marks are where the device passed them, whenever the host looked. The second
    # launch blocked the host until both steps were done; each step still gets its own device time.
    trace = StepTrace(tmp_path / "t.jsonl", {"model": "m", "block_size": 64})
    trace.launched(_batch([1, 1], [9, 9]), start=0.0, done=0.008)
    trace.called(in_flight=True, more=True)
    assert _steps(tmp_path / "t.jsonl") == []  # still on the device: not written
    trace.launched(_batch([1, 1, 500], [10, 10, 500]), start=0.008, done=0.030)
    trace.called(in_flight=True, more=True)
    trace.called(in_flight=False, more=False)  # finished the second, launched none
    trace.close()
    assert _steps(tmp_path / "t.jsonl") == [[[1, 1], [9, 9], 2, pytest.approx(0.008), 0, 0],
                                            [[1, 1, 500], [10, 10, 500], 3, pytest.approx(0.022), 0, 0]]


def test_a_step_still_on_the_device_when_the_trace_closes_is_written(tmp_path):
    trace = StepTrace(tmp_path / "t.jsonl", {"model": "m", "block_size": 64})
    trace.launched(_batch([3], [3]), start=0.0, done=0.004)
    trace.called(in_flight=True, more=True)  # the engine closes with it in flight
    trace.close()
    assert _steps(tmp_path / "t.jsonl") == [[[3], [3], 1, pytest.approx(0.004), 0, 0]]


def test_the_peaks_measured_again_as_the_trace_closes_raise_those_of_the_header_never_lower_them(tmp_path):
    """A host busy at one of the two measurements reads low there: the reader keeps the higher of each peak."""
    header = {"model": "m", "block_size": 64, "peaks": {"flops": 1e11, "bandwidth": 3e10}}
    trace = StepTrace(tmp_path / "t.jsonl", header, measure_peaks=lambda: {"flops": 2e11, "bandwidth": 2e10})
    trace.launched(_batch([3], [3]), start=0.0, done=0.004)
    trace.called(in_flight=False, more=False)
    trace.close()
    read = load_trace(tmp_path / "t.jsonl")
    assert read["peaks"] == {"flops": 2e11, "bandwidth": 3e10} and len(read["steps"]) == 1


class _SteppedClock:
    """A clock that moves one unit per mark, and as far as a test says in between."""

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:
        self.now += 1
        return self.now

    def seconds(self, a: float, b: float) -> float:
        return b - a


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_engine_emptied_by_an_abort_idles_and_its_next_step_is_not_charged_the_wait(
        tmp_path, smollm2_tokenizer, async_scheduling):
    path = tmp_path / "steps.jsonl"
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=256, num_blocks=32, step_trace=str(path),
                                    async_scheduling=async_scheduling), tokenizer=smollm2_tokenizer)
    clock = engine.step_trace.clock = _SteppedClock()
    try:
        engine.add_request("a", [11 + i for i in range(20)], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step(), engine.step()
        engine.abort_request("a")  # the client left between steps: nothing to do, the engine waits
        while engine.has_unfinished():
            engine.step()
        clock.now += 1000  # idle
        engine.add_request("b", [500 + i for i in range(20)], SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.close()
    steps = _steps(path)
    assert [q for q, *_ in steps][-2:] == [[20], [1]]  # b's prefill and its decode, traced
    assert all(seconds < 1000 for _, _, _, seconds, *_ in steps)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_traces_every_step_it_runs(tmp_path, smollm2_tokenizer, async_scheduling):
    path = tmp_path / "steps.jsonl"
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=512, num_blocks=64, max_num_batched_tokens=64,
                                    async_scheduling=async_scheduling, step_trace=str(path)),
                       tokenizer=smollm2_tokenizer)
    assert engine.overlap_steps == async_scheduling
    try:
        engine.generate([[11 + i for i in range(40)], [900 + i for i in range(100)]],
                        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        trace = load_trace(path)  # flushed when the engine went idle, before it closes
    finally:
        engine.close()
    assert trace["model_config"]["num_layers"] == engine.model_config.num_layers
    assert trace["dtype"] == "float32" and trace["block_size"] == engine.blocks.block_size
    assert trace["peaks"]["flops"] > 0 and trace["peaks"]["bandwidth"] > 0
    steps = trace["steps"]
    # 140 prompt tokens through 64-token chunks, then decodes: every token the engine computed is in the trace
    assert sum(sum(q) for q, *_ in steps) == 140 + 2 * 2
    assert max(sum(q) for q, *_ in steps) == 64 and all(seconds > 0 for _, _, _, seconds, *_ in steps)
    assert sum(rows for _, _, rows, *_ in steps) == 2 * 3  # every sampled token
    assert all(shared == 0 for *_, shared, _ in steps)  # two prompts with nothing in common
    # each request counted once, by the step that first scheduled it, not by its prompt's later chunks
    assert [admitted for *_, admitted in steps if admitted] == [2]


def test_a_step_records_the_kv_tokens_its_sequences_share_through_the_prefix_cache(tmp_path, smollm2_tokenizer):
    """b arrives after a's prompt is cached and shares its first two blocks: every step that runs both records
    those blocks' tokens as shared (read once), and a's steps alone record none."""
    path = tmp_path / "steps.jsonl"
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=512, num_blocks=64, step_trace=str(path)),
                       tokenizer=smollm2_tokenizer)
    block = engine.blocks.block_size
    common = [100 + i for i in range(2 * block)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        engine.add_request("a", common + [7, 8, 9], params)
        engine.step()  # a's prompt, whose full blocks enter the prefix cache
        engine.add_request("b", common + [5, 6], params)
        while engine.has_unfinished():
            engine.step()
        trace = load_trace(path)
    finally:
        engine.close()
    both = [shared for q, _, _, _, shared, _ in trace["steps"] if len(q) == 2]
    alone = [shared for q, _, _, _, shared, _ in trace["steps"] if len(q) == 1]
    assert both and all(shared == 2 * block for shared in both)
    assert alone and all(shared == 0 for shared in alone)


def test_a_profile_is_fitted_on_a_trace(tmp_path, smollm2_tokenizer):
    path = tmp_path / "steps.jsonl"
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=512, num_blocks=128, step_trace=str(path)),
                       tokenizer=smollm2_tokenizer)
    try:
        for n, length in [(1, 200), (4, 60), (8, 30)]:
            engine.generate([[(7 * r + j) % 5000 + 100 for j in range(length)] for r in range(n)],
                            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    finally:
        engine.close()
    result = CliRunner().invoke(app, ["sim", "fit", "--from", str(path), "--name", "served",
                                      "--out", str(tmp_path / "served.json")])
    assert result.exit_code == 0, result.output
    profile = json.loads((tmp_path / "served.json").read_text())
    assert profile["name"] == "served" and profile["source"]["points"] == len(load_trace(path)["steps"])
    assert json.loads(path.read_text().splitlines()[-1]).keys() == {"peaks"}  # measured again as it closed
    # the steps the engine ran whole in one C call (up to its fused rows, prompt tokens or not) launch no layers
    assert load_trace(path)["fused_rows"] == fused_rows(engine.runner.fused)
    assert (profile["replays_decode"], profile["whole_step_tokens"]) == (False, fused_rows(engine.runner.fused))
    assert 0 < profile["compute_efficiency"] <= 1 and 0 < profile["memory_efficiency"] <= 1

    # a trace committed gzipped (a GPU's runs to megabytes) is read as the same steps and fits the same profile
    packed = tmp_path / "steps.jsonl.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert load_trace(packed) == load_trace(path)
    result = CliRunner().invoke(app, ["sim", "fit", "--from", str(packed), "--name", "served",
                                      "--out", str(tmp_path / "served-from-gz.json")])
    assert result.exit_code == 0, result.output
    from_gz = json.loads((tmp_path / "served-from-gz.json").read_text())
    assert {k: v for k, v in from_gz.items() if k != "source"} == {k: v for k, v in profile.items() if k != "source"}


def test_a_step_trace_is_refused_with_pipeline_stages():
    with pytest.raises(ValueError, match="step_trace"):
        EngineConfig(step_trace="t.jsonl", pipeline_parallel_size=2)


def test_a_trace_the_engine_cannot_write_is_a_named_error(tmp_path, smollm2_tokenizer):
    with pytest.raises(ValueError, match=r"step_trace: cannot write .*No such file or directory"):
        LLMEngine(EngineConfig(dtype="float32", max_model_len=128, num_blocks=16,
                               step_trace=str(tmp_path / "missing" / "steps.jsonl")), tokenizer=smollm2_tokenizer)
