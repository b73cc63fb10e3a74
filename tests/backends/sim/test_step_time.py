"""The step-time model's arithmetic on a shape small enough to count by hand: each part of a step at the roofline
of what bounds it (backends/sim/step_time.py)."""

from __future__ import annotations

import pytest

from backends.native.config import ModelConfig
from backends.sim.profile import ProfileSource, StepProfile
from backends.sim.step_time import StepCost, StepTimeModel

# q = 4 heads x 16 = 64, kv = 2 x 16 = 32: a layer's linear weights (64 + 64) * 64 + 64 * 64 + 3 * 128 * 64 = 36,864
TINY = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16)
LINEAR_FLOPS_PER_TOKEN = 2 * 2 * 36_864
LM_HEAD_FLOPS_PER_ROW = 2 * 1000 * 64
WEIGHT_BYTES = 2 * (2 * 36_864 + 1000 * 64)  # bf16, the LM head included
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 2  # keys and values, 2 layers, 2 KV heads of 16, bf16
ATTENTION_FLOPS_PER_PAIR = 4 * 2 * 4 * 16  # QK^T and PV, 2 layers, 4 heads of 16


def profile(**changes) -> StepProfile:
    fields = dict(name="t", device="a test device", peak_flops=1e9, bandwidth=1e6, compute_efficiency=0.5,
                  memory_efficiency=0.5, step_overhead_s=0.001, per_sequence_s=0.0001, source=ProfileSource(how="test"))
    return StepProfile(**{**fields, **changes})


def test_the_cost_of_a_shape_is_counted_from_its_config():
    cost = StepCost.of(TINY, 2, 2)
    assert cost.linear_flops_per_token == LINEAR_FLOPS_PER_TOKEN
    assert cost.lm_head_flops_per_row == LM_HEAD_FLOPS_PER_ROW
    assert cost.weight_bytes == WEIGHT_BYTES
    assert cost.kv_bytes_per_token == KV_BYTES_PER_TOKEN
    assert cost.attention_flops_per_query_key == ATTENTION_FLOPS_PER_PAIR
    assert cost.allreduces_per_step == 0


def test_a_decode_step_on_a_slow_memory_is_bound_by_the_bytes_it_reads():
    model = StepTimeModel(profile(), StepCost.of(TINY, 2, 2))
    seconds = model.seconds([1] * 4, [100] * 4, 4)
    weights = WEIGHT_BYTES / (1e6 * 0.5)  # four tokens' FLOPs are far less
    kv = KV_BYTES_PER_TOKEN * (4 * 100 + 4) / (1e6 * 0.5)  # read every context, write the new tokens
    assert seconds == pytest.approx(0.001 + 4 * 0.0001 + weights + kv)


def test_a_prefill_step_on_a_fast_memory_is_bound_by_its_flops():
    model = StepTimeModel(profile(bandwidth=1e15), StepCost.of(TINY, 2, 2))
    seconds = model.seconds([10], [10], 1)
    linear = (10 * LINEAR_FLOPS_PER_TOKEN + LM_HEAD_FLOPS_PER_ROW) / (1e9 * 0.5)
    pairs = 10 * (10 - 4.5)  # causal: query j sees j + 1 keys
    attention = ATTENTION_FLOPS_PER_PAIR * pairs / (1e9 * 0.5)
    assert seconds == pytest.approx(0.001 + 0.0001 + linear + attention, rel=1e-9)


def test_a_chunk_after_a_cached_prefix_attends_to_the_prefix_too():
    model = StepTimeModel(profile(bandwidth=1e15), StepCost.of(TINY, 2, 2))
    fresh, after_prefix = model.seconds([10], [10], 1), model.seconds([10], [110], 1)
    assert after_prefix - fresh == pytest.approx(ATTENTION_FLOPS_PER_PAIR * 10 * 100 / (1e9 * 0.5))


def test_tensor_parallel_ranks_split_the_work_and_add_two_all_reduces_per_layer():
    p = profile(bandwidth=1e15, interconnect_bandwidth=1e6, allreduce_latency_s=1e-4)
    one, two = StepTimeModel(p, StepCost.of(TINY, 2, 2)), StepTimeModel(p, StepCost.of(TINY, 2, 2, tp=2))
    linear_1, attention_1, _ = one.parts(one_step := _work(one, [10], [10]))
    linear_2, attention_2, allreduce = two.parts(one_step)
    assert linear_2 == pytest.approx(linear_1 / 2) and attention_2 == pytest.approx(attention_1 / 2)
    payload = 10 * 64 * 2 * 2 * (2 - 1) / 2  # 10 tokens of hidden size 64 in bf16; a ring moves 2 (tp-1)/tp of it
    assert allreduce == pytest.approx(2 * 2 * (1e-4 + payload / 1e6))


def test_launches_add_to_a_cpu_step_and_hide_under_a_gpu_step_and_replayed_decodes_have_none():
    cost = StepCost.of(TINY, 2, 2)
    cpu = StepTimeModel(profile(per_layer_launch_s=0.01, launches_overlap=False, memory_overlap=0.0), cost)
    gpu = StepTimeModel(profile(per_layer_launch_s=0.01), cost)
    unlaunched = StepTimeModel(profile(launches_overlap=False, memory_overlap=0.0), cost)
    assert cpu.seconds([10], [10], 1) == pytest.approx(unlaunched.seconds([10], [10], 1) + 2 * 0.01)
    assert cpu.seconds([1, 1], [50, 50], 2) == pytest.approx(unlaunched.seconds([1, 1], [50, 50], 2))
    device = sum(gpu.parts(_work(gpu, [10], [10])))
    assert gpu.seconds([10], [10], 1) == pytest.approx(0.001 + 0.0001 + max(device, 2 * 0.01))


def test_a_cpu_steps_within_its_fused_rows_run_whole_prompt_tokens_or_not_and_larger_ones_launch_every_layer():
    """A CPU's fused C step takes any mix of prompt and decode tokens up to the rows of its small-step copies (128
    with fp32 strips): a 128-token prompt runs whole, the same prompt beside one decode launches every layer, and
    so does a decode of more sequences than the rows."""
    cost = StepCost.of(TINY, 2, 2)
    fused = StepTimeModel(profile(per_layer_launch_s=0.01, launches_overlap=False, memory_overlap=0.0,
                                  replays_decode=False, whole_step_tokens=128), cost)
    unlaunched = StepTimeModel(profile(launches_overlap=False, memory_overlap=0.0), cost)
    for q, c, launched in [([128], [128], False), ([1, 127], [300, 127], False), ([1, 128], [300, 128], True),
                           ([1] * 129, [50] * 129, True), ([1] * 128, [50] * 128, False)]:
        gap = fused.seconds(q, c, len(q)) - unlaunched.seconds(q, c, len(q))
        assert gap == pytest.approx(2 * 0.01 if launched else 0.0, abs=1e-12), (q, launched)
    every = StepTimeModel(profile(per_layer_launch_s=0.01, replays_decode=False, whole_step_tokens=None), cost)
    assert every.seconds([4096], [4096], 1) == StepTimeModel(profile(), cost).seconds([4096], [4096], 1)


@pytest.mark.parametrize("overlap", [0.0, 0.25])
def test_the_unhidden_share_of_a_parts_shorter_time_adds_to_the_longer(overlap):
    """A decode step's linear part on a memory-bound device: the weights' read, plus the share of its FLOPs' time
    not hidden behind that read (all of it for a CPU fitted at 0, none on the roofline)."""
    cost = StepCost.of(TINY, 2, 2)
    roofline, partial = StepTimeModel(profile(), cost), StepTimeModel(profile(memory_overlap=overlap), cost)
    flops_s = (4 * LINEAR_FLOPS_PER_TOKEN + 4 * LM_HEAD_FLOPS_PER_ROW) / (1e9 * 0.5)
    work = _work(roofline, [1] * 4, [100] * 4)
    assert partial.parts(work)[0] - roofline.parts(work)[0] == pytest.approx((1 - overlap) * flops_s)


def _work(model, query_lens, context_lens):
    from backends.sim.step_time import StepWork

    return StepWork.of(query_lens, context_lens, len(query_lens))


@pytest.mark.parametrize("saved, overlap", [(True, 1.0), (False, 0.0)])
def test_a_profile_saved_with_the_earlier_yes_or_no_overlap_loads_as_that_share(saved, overlap):
    fields = profile().model_dump()
    del fields["memory_overlap"]
    assert StepProfile.model_validate({**fields, "overlaps_memory": saved}).memory_overlap == overlap


def test_a_step_run_whole_computes_at_the_profiles_whole_step_efficiency_and_a_step_launched_at_the_other():
    """A CPU's fused step runs kernels of its own: a step within its rows computes at the whole-step efficiency,
    a larger one at the profile's compute efficiency; without a whole-step efficiency both use the latter."""
    cost = StepCost.of(TINY, 2, 2)
    fused = dict(bandwidth=1e15, launches_overlap=False, replays_decode=False, whole_step_tokens=16)
    plain, own = StepTimeModel(profile(**fused), cost), StepTimeModel(profile(**fused, whole_step_compute_efficiency=0.25), cost)
    whole, launched = _work(plain, [16], [16]), _work(plain, [17], [17])
    assert own.parts(whole)[0] == pytest.approx(2 * plain.parts(whole)[0])  # half the efficiency: twice the time
    assert own.parts(launched) == plain.parts(launched)


def test_attention_computes_at_the_profiles_attention_efficiency_in_every_step_and_the_linear_layers_do_not():
    """Attention runs kernels of its own (a CPU's paged-attention C kernels): with an attention efficiency, a chunk
    over a cached history spends its query-key FLOPs at that efficiency, whether its step ran whole or launched
    layer by layer; its linear layers keep theirs. Without one, attention computes at its step's efficiency."""
    cost = StepCost.of(TINY, 2, 2)
    fast_memory = dict(bandwidth=1e15, replays_decode=False, whole_step_tokens=16, whole_step_compute_efficiency=0.4)
    plain = StepTimeModel(profile(**fast_memory), cost)
    own = StepTimeModel(profile(**fast_memory, attention_compute_efficiency=0.1), cost)
    for query in (8, 64):  # run whole (at 0.4), launched (at 0.5)
        work = _work(plain, [query], [4096])
        step_efficiency = 0.4 if query <= 16 else 0.5
        assert plain.parts(work)[1] == pytest.approx(ATTENTION_FLOPS_PER_PAIR * work.query_keys / (1e9 * step_efficiency))
        assert own.parts(work)[1] == pytest.approx(ATTENTION_FLOPS_PER_PAIR * work.query_keys / (1e9 * 0.1))
        assert own.parts(work)[0] == plain.parts(work)[0]


@pytest.mark.parametrize("reuse", [1.0, 0.5, 0.0])
def test_the_caches_serve_the_profiles_share_of_reads_of_kv_blocks_several_sequences_share(reuse):
    """Eight decodes whose contexts of 300 start with the same 256 cached tokens: with every shared read served by
    the caches they read 8 x 44 + 256 tokens of KV cache from memory, not 8 x 300; with none, all of them. Their
    attention computes against every key either way."""
    from backends.sim.step_time import StepWork

    alone, shared = StepWork.of([1] * 8, [300] * 8, 8), StepWork.of([1] * 8, [300] * 8, 8, shared_tokens=7 * 256)
    assert (shared.kv_read_tokens, shared.shared_kv_tokens, shared.query_keys) == (8 * 300, 7 * 256, alone.query_keys)
    model = StepTimeModel(profile(kv_cache_reuse=reuse), StepCost.of(TINY, 2, 2))
    saved = model.seconds([1] * 8, [300] * 8, 8) - model.seconds([1] * 8, [300] * 8, 8, shared_tokens=7 * 256)
    assert saved == pytest.approx(reuse * KV_BYTES_PER_TOKEN * 7 * 256 / (1e6 * 0.5))  # a KV-bound step, slow memory
