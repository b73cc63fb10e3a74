"""The step trace: every step the engine runs, with its batch and its share of the engine's time line, written
while it serves, read back as the steps a simulator profile is fitted on."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from backends.base import SamplingParams
from backends.native.batch import Batch
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine
from backends.native.step_trace import StepTrace, load_trace
from gateway.cli import app


def _batch(query_lens: list[int], context_lens: list[int]) -> Batch:
    return Batch([], [], [], query_lens, context_lens, [], [True] * len(query_lens))


def _steps(path) -> list[list]:
    return load_trace(path)["steps"]


def test_a_synchronous_step_lasts_until_the_next_one_starts(tmp_path):
    trace = StepTrace(tmp_path / "t.jsonl", {"model": "m"})
    trace.step(_batch([5, 7], [5, 7]), start=1.0, end=1.3, overlapped=False, more=True)
    trace.step(_batch([1, 1], [6, 8]), start=1.5, end=1.6, overlapped=False, more=True)  # 0.2 s of host work before
    trace.step(_batch([1], [9]), start=1.7, end=1.75, overlapped=False, more=False)  # then the engine idles
    trace.close()
    assert _steps(tmp_path / "t.jsonl") == [[[5, 7], [5, 7], 2, pytest.approx(0.5)],
                                            [[1, 1], [6, 8], 2, pytest.approx(0.2)],
                                            [[1], [9], 1, pytest.approx(0.05)]]


def test_an_async_step_lasts_from_its_launch_returning_to_the_call_that_finished_it(tmp_path):
    trace = StepTrace(tmp_path / "t.jsonl", {"model": "m"})
    trace.step(_batch([4], [4]), start=0.0, end=0.01, overlapped=True, more=True)  # launched, nothing to finish
    trace.step(_batch([1], [5]), start=0.02, end=0.30, overlapped=True, more=True)  # waited for the first
    trace.step(None, start=0.31, end=0.50, overlapped=False, more=False)  # finished the second, launched none
    trace.close()
    assert _steps(tmp_path / "t.jsonl") == [[[4], [4], 1, pytest.approx(0.29)], [[1], [5], 1, pytest.approx(0.20)]]


def test_the_engine_traces_every_step_it_runs(tmp_path, smollm2_tokenizer):
    path = tmp_path / "steps.jsonl"
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=512, num_blocks=64, max_num_batched_tokens=64,
                                    step_trace=str(path)), tokenizer=smollm2_tokenizer)
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
    assert max(sum(q) for q, *_ in steps) == 64 and all(seconds > 0 for *_, seconds in steps)
    assert sum(rows for _, _, rows, _ in steps) == 2 * 3  # every sampled token


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
    assert 0 < profile["compute_efficiency"] <= 1 and 0 < profile["memory_efficiency"] <= 1


def test_a_step_trace_is_refused_with_pipeline_stages():
    with pytest.raises(ValueError, match="step_trace"):
        EngineConfig(step_trace="t.jsonl", pipeline_parallel_size=2)


def test_a_trace_the_engine_cannot_write_is_a_named_error(tmp_path, smollm2_tokenizer):
    with pytest.raises(ValueError, match=r"step_trace: cannot write .*No such file or directory"):
        LLMEngine(EngineConfig(dtype="float32", max_model_len=128, num_blocks=16,
                               step_trace=str(tmp_path / "missing" / "steps.jsonl")), tokenizer=smollm2_tokenizer)
