"""Pipeline parallelism on CPU (gloo, one process per extra rank): every split serves the same model, each rank
holding only its stage's layers.

A 5-layer random-weight Llama (8 query / 2 KV heads, a tied LM head) serves 12 prompts, four of them sharing a
long prefix, with prefix caching, chunked prefill (a 64-token step budget) and preemption (a KV cache too small
for the batch) in play: greedy continuations are identical split into 2 stages (vLLM's default partition, 3 + 2
layers), 3 uneven stages (1 + 3 + 1, as ``VLLM_PP_LAYER_PARTITION`` gives it), 2 tensor x 2 pipeline ranks, and
in one process. The stages keep several batches in flight, each of sequences no other batch holds. A rank lost
mid-burst is tests/backends/native/test_tensor_parallel.py's check, shared.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine
from backends.native.model_runner import kv_bytes_per_block
from backends.native.parallel import stage_layers
from tests.backends.native.reference import LONG_CONTEXT
from tests.backends.native.splits import rank_weight_bytes

NEW_TOKENS = 24
@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    shared = [LONG_CONTEXT + end for end in ("In summary,", "The key idea was", "Next came", "Finally,")]
    texts = [*shared, "Hello there", "1 2 3", "A", "def f(x):", "Paris is", "Roses are red,", "Step 1:", "<html>"]
    return [smollm2_tokenizer.encode(t) for t in texts]


def _engine(path, tokenizer, **split) -> LLMEngine:
    # 24 blocks of 16 tokens hold about half of the batch's sequences: preemption is certain
    config = EngineConfig(model_path=str(path), dtype="float32", max_model_len=512, block_size=16, num_blocks=24,
                          max_num_batched_tokens=64, num_threads=1, **split)
    return LLMEngine(config, tokenizer=tokenizer)


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def one_process(tiny_llama, smollm2_tokenizer, prompts):
    """(greedy continuations, the engine's preemptions and prefix-cache hits) in one process."""
    engine = _engine(tiny_llama, smollm2_tokenizer)
    tokens = _greedy(engine, prompts)
    return tokens, engine.scheduler.num_preemptions, engine.blocks.prefix_hits


@pytest.mark.parametrize("split", [
    {"pipeline_parallel_size": 2},
    {"pipeline_parallel_size": 3, "pipeline_layer_partition": [1, 3, 1]},
    {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
], ids=["pp2", "pp3-uneven", "tp2-pp2"])
def test_every_split_serves_the_same_tokens_each_rank_holding_only_its_layers(tiny_llama, smollm2_tokenizer, prompts,
                                                                             one_process, split):
    reference, preemptions, hits = one_process
    assert preemptions > 0 and hits > 0  # the workload exercises both
    engine = _engine(tiny_llama, smollm2_tokenizer, **split)
    try:
        assert _greedy(engine, prompts) == reference
        assert engine.scheduler.num_preemptions > 0 and engine.blocks.prefix_hits > 0
        tp, pp = engine.config.tensor_parallel_size, engine.config.pipeline_parallel_size
        layers = stage_layers(5, pp, engine.config.pipeline_layer_partition)
        expected = [rank_weight_bytes(engine.model_config, tp, len(layers[s]), s == 0, s == pp - 1)
                    for s in range(pp) for _ in range(tp)]
        per_rank = engine.runner.call("weight_bytes")
        copies = engine.runner.call("small_step_copy_bytes")  # a second copy for small steps (linear.py)
        held_once = [b - c for b, c in zip(per_rank, copies)]
        assert all(abs(b - e) <= 0.01 * e for b, e in zip(held_once, expected, strict=True)), (held_once, expected)
        # /info's KV bytes are the engine process's rank's: the last stage's layers
        assert engine.settings()["kv_cache_bytes"] == engine.blocks.num_blocks * kv_bytes_per_block(
            engine.model_config, 16, torch.float32, tp, len(layers[-1]))
        assert not engine.has_unfinished() and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    finally:
        engine.close()
    assert not multiprocessing.active_children()


def test_stages_keep_several_batches_of_different_sequences_in_flight(tiny_llama, smollm2_tokenizer, prompts):
    engine = _engine(tiny_llama, smollm2_tokenizer, pipeline_parallel_size=2)
    in_flight: list[int] = []  # batches launched and not finished, as each new one is scheduled
    overlaps: list[set] = []  # sequences a new batch shares with those in flight
    schedule = engine.scheduler.schedule

    def watched(busy=frozenset(), max_seqs=None):
        scheduled = schedule(busy, max_seqs)
        if scheduled is not None:
            in_flight.append(len(engine._pipeline))
            overlaps.append(set(scheduled.seqs) & {s for step in engine._pipeline for s in step.seqs})
        return scheduled

    engine.scheduler.schedule = watched
    try:
        _greedy(engine, prompts)
        assert max(in_flight) == 1  # two batches at once: one per stage, never more
        assert in_flight.count(1) > len(in_flight) / 3
        assert not any(overlaps)
        outbox = engine.runner.rank.outbox  # each step's batch posted to the other rank: sends waited for, not kept
        assert 0 < len(outbox.pending) <= outbox.limit < len(in_flight)
    finally:
        engine.close()


def test_a_step_that_fails_part_way_stops_the_engine_rather_than_run_out_of_step(tiny_llama, smollm2_tokenizer,
                                                                                 prompts):
    engine = _engine(tiny_llama, smollm2_tokenizer, pipeline_parallel_size=2)
    try:
        def fail(*args):
            raise MemoryError("no memory for the step's metadata")

        engine.runner.local.kernels.attention.build = fail  # before the driver reads stage 0's hidden states
        with pytest.raises(MemoryError):
            _greedy(engine, prompts[:2])
        assert not engine.alive  # stage 0's hidden states of that step are unread: nothing may run after it
        with pytest.raises(RuntimeError, match="out of step since a failed step"):
            engine.runner.execute(engine.scheduler.schedule().batch)
    finally:
        engine.close()
    assert not multiprocessing.active_children()


def test_layer_partitions_follow_vllm():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert [len(s) for s in stage_layers(26, 4)] == [6, 7, 7, 6]  # the remainder before the last stage
    assert stage_layers(5, 3, [1, 3, 1]) == [range(0, 1), range(1, 4), range(4, 5)]


def test_vllm_pp_layer_partition_is_read(monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,4")
    assert stage_layers(5, 2) == [range(0, 1), range(1, 5)]


@pytest.mark.parametrize("split, message", [
    ({"pipeline_parallel_size": 6}, "pipeline_parallel_size 6 is more than the model's 5 layers"),
    ({"pipeline_parallel_size": 2, "pipeline_layer_partition": [2, 2]}, r"\[2, 2\] must give each stage"),
    ({"pipeline_parallel_size": 3, "pipeline_layer_partition": [2, 3]}, "has 2 stages, pipeline_parallel_size is 3"),
])
def test_a_split_that_does_not_fit_the_model_is_refused_before_any_rank_starts(tiny_llama, smollm2_tokenizer, split,
                                                                              message):
    with pytest.raises(ValueError, match=message):
        _engine(tiny_llama, smollm2_tokenizer, **split)
    assert not multiprocessing.active_children()


def test_a_stage_without_layers_is_refused_where_the_config_is_read():
    with pytest.raises(ValueError, match="at least one layer"):
        EngineConfig(pipeline_parallel_size=2, pipeline_layer_partition=[5, 0])


def test_a_simulated_replica_refuses_pipeline_settings_it_would_not_model():
    with pytest.raises(ValueError, match="runs no ranks"):
        EngineConfig(simulate={"profile": "h100"}, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="runs no ranks"):
        EngineConfig(simulate={"profile": "h100"}, distributed_executor_backend="ray")


def test_with_batches_in_flight_host_side_sampling_and_aborts_behave_as_in_one_process(tiny_llama, smollm2_tokenizer,
                                                                                       prompts):
    """Parallel samples (forks joining after their prompt), seeded sampling, logprobs and prompt logprobs, penalties
    (which read every token on the host): the same as one process; requests aborted while their batch is in flight
    leave nothing behind and change no other request's tokens."""
    params = [SamplingParams(max_tokens=12, n=2, temperature=0.8, seed=7),
              SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2),
              SamplingParams(max_tokens=8, temperature=0.0, logprobs=3),
              SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)]
    chosen = [prompts[4], prompts[0], prompts[6], prompts[9]]
    single = _engine(tiny_llama, smollm2_tokenizer)
    one = single.generate(chosen, params)
    engine = _engine(tiny_llama, smollm2_tokenizer, pipeline_parallel_size=2)
    try:
        split = engine.generate(chosen, params)
        assert [o.token_ids for o in split] == [o.token_ids for o in one]
        assert [[(t.token, round(t.logprob, 4)) for t in o.logprobs] for o in split[3:4]] == \
            [[(t.token, round(t.logprob, 4)) for t in o.logprobs] for o in one[3:4]]
        first, again = one[2].prompt_logprobs[1:], split[2].prompt_logprobs[1:]
        assert [t.logprob for t in again] == pytest.approx([t.logprob for t in first], abs=1e-4)

        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts[:6]):
            engine.add_request(f"r{i}", prompt, greedy)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(6)}
        for _ in range(3):
            for rid, chunk in engine.step():
                tokens[rid] += chunk.token_ids
        assert engine._pipeline  # batches are in flight
        for rid in ("r1", "r4"):
            engine.abort_request(rid)
        while engine.has_unfinished():
            for rid, chunk in engine.step():
                tokens[rid] += chunk.token_ids
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine._busy
        kept = [0, 2, 3, 5]
        alone = single.generate([prompts[i] for i in kept], greedy)
        assert [tokens[f"r{i}"] for i in kept] == [o.token_ids for o in alone]
    finally:
        engine.close()
