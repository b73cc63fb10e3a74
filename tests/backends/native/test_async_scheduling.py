"""Async scheduling (vLLM's ``--async-scheduling``): the next step is scheduled and launched before the
previous step's tokens reach the host, over placeholders the device fills in. It changes when a token is
seen, never which: every output equals the synchronous engine's, no step runs past a length limit, nothing
leaks. On by default on CUDA; here, on the CPU, it is switched on to check the bookkeeping.
"""

from __future__ import annotations

import pytest
import torch

from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,", "Hello, my name is",
         "The best way to learn"]


def _params(stop_token: int) -> list[SamplingParams]:
    """Every way a sequence ends: length, a stop string and a stop token mid-flight, EOS ignored; greedy and
    seeded draws (the same with or without async scheduling)."""
    return [SamplingParams(max_tokens=20, temperature=0.0),
            SamplingParams(max_tokens=20, temperature=0.8, seed=3),
            SamplingParams(max_tokens=20, temperature=0.0, stop=[" the"]),
            SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_token]),
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=16, temperature=1.0, seed=5, top_k=20)]


def _engine(tokenizer, overlap: bool, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8,
                                  async_scheduling=overlap, **settings), tokenizer=tokenizer)


def _run(engine: LLMEngine, prompts, params) -> list[tuple]:
    outs = engine.generate(prompts, params)
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return [(o.text, o.token_ids, o.finish_reason, o.usage.completion_tokens) for o in outs]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return [smollm2_tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def engines(smollm2_tokenizer):
    return _engine(smollm2_tokenizer, False), _engine(smollm2_tokenizer, True)


@pytest.fixture(scope="module")
def stop_token(engines, prompts) -> int:
    """A token the fourth prompt's greedy continuation reaches after a few steps."""
    (out,) = engines[0].generate(prompts[3:4], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    return out.token_ids[5]


@pytest.mark.parametrize("blocks", [None, {"num_blocks": 4, "block_size": 16}], ids=["roomy", "preempting"])
def test_outputs_equal_the_synchronous_engines_for_every_way_of_stopping(engines, prompts, stop_token, blocks,
                                                                        smollm2_tokenizer):
    if blocks:
        engines = _engine(smollm2_tokenizer, False, **blocks), _engine(smollm2_tokenizer, True, **blocks)
    sync, overlapped = engines
    assert overlapped.overlap_steps and not sync.overlap_steps
    expected = _run(sync, prompts, _params(stop_token))
    assert _run(overlapped, prompts, _params(stop_token)) == expected
    assert [r[2] for r in expected][2:5] == ["stop", "stop", "length"]
    assert overlapped.stats().preemptions == sync.stats().preemptions
    assert sync.stats().preemptions > 0 if blocks else sync.stats().preemptions == 0
    assert overlapped.stats().prefix_cache_hits == sync.stats().prefix_cache_hits  # placeholders never hashed


def test_a_steps_tokens_arrive_with_the_next_call_and_no_step_runs_past_max_tokens(engines, prompts):
    overlapped = engines[1]
    steps = {}
    for engine in engines:
        calls, execute = [], engine.runner.execute
        engine.runner.execute = lambda *a, calls=calls, execute=execute, **k: calls.append(1) or execute(*a, **k)
        try:
            _run(engine, prompts, [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * len(prompts))
        finally:
            del engine.runner.execute
        steps[engine is overlapped] = len(calls)
    assert steps[True] == steps[False]  # a placeholder that is a sequence's last token is not computed

    overlapped.add_request("r", prompts[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert overlapped.step() == []  # the prompt's step is launched; its token is still on the device
    first = overlapped.step()  # the first decode is launched, the prompt's token applied
    assert [(rid, len(chunk.token_ids)) for rid, chunk in first] == [("r", 1)]
    while overlapped.has_unfinished():
        last = overlapped.step()
    assert last[-1][1].finish_reason == "length" and overlapped.blocks.num_free_blocks == overlapped.blocks.num_blocks


def test_requests_that_read_their_tokens_on_the_host_run_synchronously_beside_the_others(engines, prompts,
                                                                                          stop_token):
    sync, overlapped = engines
    params = [*_params(stop_token)[:3], SamplingParams(max_tokens=12, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3), _params(stop_token)[5]]
    assert _run(overlapped, prompts, params) == _run(sync, prompts, params)
    outs = overlapped.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, logprobs=1))
    assert len(outs[0].logprobs) == 4


def test_aborting_while_a_step_is_in_flight_frees_everything(engines, prompts):
    _, overlapped = engines
    overlapped.add_request("a", prompts[0], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    overlapped.add_request("b", prompts[1], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    overlapped.step()
    overlapped.step()
    overlapped.abort_request("a")
    outputs = []
    while overlapped.has_unfinished():
        outputs += overlapped.step()
    assert {rid for rid, _ in outputs} == {"b"} and outputs[-1][1].finish_reason == "length"
    assert overlapped.blocks.num_free_blocks == overlapped.blocks.num_blocks


def test_async_scheduling_is_on_by_default_on_cuda_only_and_never_across_tensor_parallel_ranks():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert EngineConfig().overlaps_steps(cuda) and not EngineConfig().overlaps_steps(cpu)
    assert EngineConfig(async_scheduling=True).overlaps_steps(cpu)
    assert not EngineConfig(async_scheduling=False).overlaps_steps(cuda)
    assert not EngineConfig(async_scheduling=True, tensor_parallel_size=2).overlaps_steps(cuda)
