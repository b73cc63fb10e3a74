"""A fleet of simulated replicas on a virtual clock (backends/sim/virtual.py): the native engine's scheduler and
block manager in each, the gateway's policies routing, the load tester's metrics over what clients would see."""

from __future__ import annotations

import pytest
import typer

from backends.native.config import EngineConfig, SimulationConfig
from backends.sim.virtual import SimRequest, VirtualFleet, burst_workload, conversation_workload
from gateway.routing.cache_aware import CacheAwareConfig
from gateway.routing.round_robin import RoundRobinConfig
from tests.backends.sim.profiles import constant_step_profile

DESIGN = "configs/llama-12.3b-gqa.json"


@pytest.fixture(scope="module")
def h100(smollm2_tokenizer):
    def fleet(replicas: int, routing=None, **engine) -> VirtualFleet:
        config = EngineConfig(model_path=DESIGN, simulate=SimulationConfig(profile="h100"), max_num_seqs=64,
                              max_num_batched_tokens=4096, **engine)
        return VirtualFleet(config, replicas, routing or RoundRobinConfig(), smollm2_tokenizer)

    return fleet


def test_every_request_is_answered_in_full_on_the_simulated_clock(h100):
    requests = burst_workload(40, 256, 32, [0.1 * i for i in range(40)])
    fleet = h100(2)
    result = fleet.run(requests)
    s = result.summary
    assert s["completed"] == 40 and s["failed"] == 0 and s["total_output_tokens"] == 40 * 32
    assert all(r.output_tokens == 32 and len(r.chunk_times) == 32 for r in result.records)
    assert all(r.actual_send == r.target_send for r in result.records)  # a virtual client is never late
    assert result.virtual_s >= 3.9  # the last request arrives at 3.9 s
    assert not any(r.engine.has_unfinished() or r.engine.blocks.usage for r in fleet.replicas)  # nothing left


def test_a_replica_runs_one_step_at_a_time_and_tokens_arrive_when_their_step_ends(tmp_path, smollm2_tokenizer):
    """With every step 0.1 s long, one request of 4 tokens arriving at 0 gets them at 0.1, 0.2, 0.3, 0.4 s; a
    second arriving at 0.05 joins the second step."""
    config = EngineConfig(model_path=DESIGN, simulate=SimulationConfig(profile=str(constant_step_profile(tmp_path))))
    result = VirtualFleet(config, 1, RoundRobinConfig(), smollm2_tokenizer).run(
        [SimRequest(0.0, list(range(1000, 1010)), 4), SimRequest(0.05, list(range(2000, 2010)), 2)])
    first, second = result.records
    assert first.chunk_times == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert second.chunk_times == pytest.approx([0.2, 0.3]) and second.ttft == pytest.approx(0.15)


def _front_end_run(tmp_path, tokenizer, requests: list[SimRequest], **front_end) -> list:
    """``requests`` on one replica whose every step takes 0.1 s, behind a front end of ``front_end``."""
    config = EngineConfig(model_path=DESIGN, simulate=SimulationConfig(profile=str(constant_step_profile(tmp_path))))
    return VirtualFleet(config, 1, RoundRobinConfig(), tokenizer, **front_end).run(requests).records


def test_the_front_end_passes_one_request_at_a_time(tmp_path, smollm2_tokenizer):
    """Three requests sent together behind a front end of 0.5 s a request reach the engine at 0.5, 1.0 and
    1.5 s (an asyncio front end in one process): each finds the engine idle and runs alone."""
    burst = [SimRequest(0.0, list(range(1000 * r, 1000 * r + 10)), 2) for r in (1, 2, 3)]
    records = _front_end_run(tmp_path, smollm2_tokenizer, burst, frontend_s=0.5)
    assert [r.chunk_times for r in records] == [pytest.approx(t) for t in ([0.6, 0.7], [1.1, 1.2], [1.6, 1.7])]


def test_with_an_ideal_front_end_a_request_sent_as_a_step_ends_joins_the_step_that_starts_then(tmp_path,
                                                                                              smollm2_tokenizer):
    """Steps of 0.1 s: the second request, sent at 0.1 s as the first step ends, runs in the second step."""
    first, second = _front_end_run(tmp_path, smollm2_tokenizer, [SimRequest(0.0, list(range(1000, 1010)), 2),
                                                                  SimRequest(0.1, list(range(2000, 2010)), 1)])
    assert first.chunk_times == pytest.approx([0.1, 0.2]) and second.chunk_times == pytest.approx([0.2])


def test_a_step_on_the_front_ends_host_waits_out_the_front_ends_queued_work(tmp_path, smollm2_tokenizer):
    """With the front end on the engine's cores (a CPU engine), the first request's step starts at 0.5 s with two
    requests still queued in the front end until 1.5 s, and takes 0.1 s after that; the two join the next step."""
    burst = [SimRequest(0.0, list(range(1000 * r, 1000 * r + 10)), 2) for r in (1, 2, 3)]
    records = _front_end_run(tmp_path, smollm2_tokenizer, burst, frontend_s=0.5, frontend_shares_host=True)
    assert [r.chunk_times for r in records] == [pytest.approx(t) for t in ([1.6, 1.7], [1.7, 1.8], [1.7, 1.8])]


def test_a_turn_sent_after_its_think_time_passes_the_front_end_too(tmp_path, smollm2_tokenizer):
    """The answer ends at 0.7 s; the next turn is sent 1 s later and reaches the engine 0.5 s after that."""
    (conversation,) = conversation_workload(users=1, turns=2, system_len=8, question_len=4, output_len=2,
                                            arrivals=[0.0], think_s=1.0)
    first, second = _front_end_run(tmp_path, smollm2_tokenizer, [conversation], frontend_s=0.5)
    assert first.chunk_times == pytest.approx([0.6, 0.7])
    assert second.target_send == pytest.approx(1.7) and second.chunk_times == pytest.approx([2.3, 2.4])


EVEN_SPREAD = [0.5 + i / 100 for i in range(101)]  # measured / modelled spread evenly over 0.5-1.5


def _step_times(tmp_path, tokenizer, requests: int = 1, fleet_seed: int = 0, **simulate) -> list[list[float]]:
    """Each request's step times (200 tokens alone on its replica) on a device modelled at 0.1 s a step."""
    profile = constant_step_profile(tmp_path, 0.1, EVEN_SPREAD)
    config = EngineConfig(model_path=DESIGN, simulate=SimulationConfig(profile=str(profile), **simulate))
    work = [SimRequest(0.0, list(range(1000 * (r + 1), 1000 * (r + 1) + 10)), 200) for r in range(requests)]
    records = VirtualFleet(config, requests, RoundRobinConfig(), tokenizer, seed=fleet_seed).run(work).records
    return [[b - a for a, b in zip([0.0, *r.chunk_times], r.chunk_times)] for r in records]


def test_each_step_takes_its_modelled_time_times_a_draw_from_the_profiles_step_spread(tmp_path, smollm2_tokenizer):
    (steps,) = _step_times(tmp_path, smollm2_tokenizer)
    assert min(steps) >= 0.05 - 1e-9 and max(steps) <= 0.15 + 1e-9  # 0.1 s times a ratio of 0.5-1.5
    assert len({round(s, 9) for s in steps}) > 150 and sum(steps) / len(steps) == pytest.approx(0.1, abs=0.007)
    (exact,) = _step_times(tmp_path, smollm2_tokenizer, spread=False)  # simulate.spread off: the model's time
    assert exact == pytest.approx([0.1] * 200)


def test_the_spreads_draws_are_seeded_and_each_replica_draws_its_own(tmp_path, smollm2_tokenizer):
    first, second = _step_times(tmp_path, smollm2_tokenizer, requests=2)
    assert _step_times(tmp_path, smollm2_tokenizer, requests=2) == [first, second]  # the same seed, the same steps
    assert first != second  # two replicas, two streams
    assert _step_times(tmp_path, smollm2_tokenizer, requests=2, fleet_seed=1)[0] != first  # the fleet's seed
    assert _step_times(tmp_path, smollm2_tokenizer, requests=2, seed=1)[0] != first  # and the engine's own


@pytest.mark.parametrize("reuse", [1.0, 0.0])
def test_the_caches_serve_the_profiles_share_of_reads_of_blocks_two_sequences_share(reuse, tmp_path, smollm2_tokenizer):
    """b arrives once a's 2,000-token prompt is cached: with the same prompt, each step that decodes both is
    shorter than with a prompt of its own by the ``kv_cache_reuse`` share of the read of the 1,984 tokens of full
    blocks they share (an H100 profile made to reuse them all, and as shipped: none, not measured on a GPU)."""
    from backends.sim.fit import model_cost
    from backends.sim.profile import load_profile

    profile = load_profile("h100").model_copy(update={"kv_cache_reuse": reuse})
    profile.save(path := tmp_path / "h100.json")
    config = EngineConfig(model_path=DESIGN, simulate=SimulationConfig(profile=str(path)), max_num_seqs=64,
                          max_num_batched_tokens=4096)
    prefix = list(range(1000, 3000))

    def b_step_s(b_prompt: list[int]) -> float:
        fleet = VirtualFleet(config, 1, RoundRobinConfig(), smollm2_tokenizer)
        _, b = fleet.run([SimRequest(0.0, prefix + [7], 400), SimRequest(0.2, b_prompt + [8], 20)]).records
        return b.chunk_times[-1] - b.chunk_times[-2]  # a step of both decodes

    shared, alone = b_step_s(prefix), b_step_s(list(range(5000, 7000)))
    read = model_cost("design_12b").kv_bytes_per_token * (2000 // 16 * 16) / (profile.bandwidth * profile.memory_efficiency)
    assert alone - shared == pytest.approx(reuse * read, rel=1e-6, abs=1e-12)


def test_each_turn_of_a_conversation_carries_the_whole_history(h100):
    requests = conversation_workload(users=2, turns=3, system_len=300, question_len=20, output_len=10,
                                     arrivals=[0.0, 0.0], think_s=1.0)
    result = h100(2).run(requests)
    assert result.summary["completed"] == 6
    prompts = sorted(r.prompt_tokens for r in result.records)
    assert prompts == [320, 320, 350, 350, 380, 380]  # + the previous answer (10) and question (20) per turn


def test_a_users_own_history_comes_before_the_first_question_and_stays_in_every_turn(h100):
    requests = conversation_workload(users=2, turns=2, system_len=300, question_len=20, output_len=10,
                                     arrivals=[0.0, 0.0], history_len=500)
    assert requests[0].prompt[:300] == requests[1].prompt[:300]  # the system prompt, shared
    assert requests[0].prompt[300:800] != requests[1].prompt[300:800]  # each user's own context
    result = h100(1).run(requests)
    assert sorted(r.prompt_tokens for r in result.records) == [820, 820, 850, 850]


def test_a_history_that_comes_back_re_rendered_is_found_in_cache_only_as_far_as_it_was_kept(h100):
    """A served chat sends each answer back as text; where that does not tokenize back to the ids generated, the
    prefix cache misses from there (``kept``); by default the whole history comes back as it was."""
    requests = conversation_workload(users=1, turns=3, system_len=320, question_len=16, output_len=10,
                                     arrivals=[0.0], kept=[[None, 320]])
    result = h100(1, block_size=16).run(requests)
    turns = sorted(result.records, key=lambda r: r.prompt_tokens)
    assert [r.prompt_tokens for r in turns] == [336, 362, 388]
    assert [r.cached_tokens for r in turns] == [0, 336, 320]  # 345 tokens computed, 21 full blocks; then 320 kept


def test_cache_aware_routing_keeps_conversations_where_their_prefix_is_cached(h100):
    requests = conversation_workload(users=8, turns=4, system_len=512, question_len=64, output_len=16,
                                     arrivals=[0.2 * i for i in range(8)], think_s=0.5)
    aware = h100(4, CacheAwareConfig(block_size=16)).run(requests)
    spread = h100(4, RoundRobinConfig()).run(requests)
    assert aware.summary["completed"] == spread.summary["completed"] == 32
    assert aware.summary["cached_token_rate"] > spread.summary["cached_token_rate"]
    assert aware.summary["cached_token_rate"] > 0.6


def test_a_small_kv_cache_preempts_and_still_answers_everything(h100):
    result = h100(1, num_blocks=80).run(burst_workload(16, 200, 64, [0.0] * 16))  # 80 x 16 tokens: 4-5 at a time
    assert result.summary["completed"] == 16
    assert sum(r["preemptions"] for r in result.per_replica.values()) > 0


def test_the_same_workload_and_seed_give_the_same_numbers(h100):
    requests = burst_workload(30, 128, 16, [0.05 * i for i in range(30)], seed=3)
    first = h100(3, CacheAwareConfig(block_size=16)).run(requests).summary
    second = h100(3, CacheAwareConfig(block_size=16)).run(requests).summary
    assert first == second


def test_a_fleet_needs_simulated_engines(smollm2_tokenizer):
    with pytest.raises(ValueError, match="simulate"):
        VirtualFleet(EngineConfig(model_path=DESIGN), 2, RoundRobinConfig(), smollm2_tokenizer)


def test_a_load_test_dataset_runs_with_its_own_output_lengths_and_shared_text_is_cached(tmp_path):
    import json

    from typer.testing import CliRunner

    from gateway.cli import app

    shared = "You are a careful assistant who answers questions about ships and the sea. " * 12
    lines = [{"prompt": shared + "What is a keel?", "max_tokens": 5}, {"prompt": shared + "What is a mast?",
                                                                      "max_tokens": 7},
             {"prompt": "Tell me about rivers.", "max_tokens": 9}]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(app, ["sim", "run", "--model", DESIGN, "--dataset", str(dataset), "--requests", "3",
                                      "--rate", "1", "--arrivals", "constant", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)["summary"]
    assert summary["completed"] == 3 and summary["total_output_tokens"] == 5 + 7 + 9
    assert summary["cached_token_rate"] > 0  # the second of the two sharing their start found it cached


def test_a_request_no_replica_can_take_fails_as_a_400_would_and_the_rest_run(h100):
    too_long = SimRequest(0.0, list(range(1000, 1000 + 4090)), 64)  # 4,154 tokens: past the model's 4,096
    result = h100(2).run([too_long, *burst_workload(3, 64, 8, [0.0] * 3)])
    s = result.summary
    assert s["completed"] == 3 and s["failed"] == 1 and s["failures_by_kind"] == {"http_400": 1}
    assert "maximum context length" in result.records[0].error


def test_sim_run_names_conversations_as_the_load_tester_does():
    """`--users N --turns T --system-prompt-len S`: N conversations of T turns sharing S tokens of system prompt."""
    import json

    from typer.testing import CliRunner

    from gateway.cli import app

    result = CliRunner().invoke(app, ["sim", "run", "--model", DESIGN, "--replicas", "2", "--users", "3", "--turns",
                                      "2", "--system-prompt-len", "256", "--question-len", "16", "--output-len", "4",
                                      "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])["summary"]
    assert summary["completed"] == 3 * 2 and summary["total_output_tokens"] == 3 * 2 * 4
    assert summary["cached_token_rate"] > 0  # the shared system prompt and each conversation's history


@pytest.mark.parametrize(("args", "says"), [
    (["--turns", "3"], "add --users"),
    (["--system-prompt-len", "100"], "add --users"),
    (["--user-history-len", "100"], "add --users"),
    (["--users", "2", "--requests", "5"], "drop --requests"),
    (["--users", "2", "--prefix-len", "100"], "drop --prefix-len"),
])
def test_sim_run_refuses_options_of_another_kind_of_traffic(args, says):
    from typer.testing import CliRunner

    from gateway.cli import app

    result = CliRunner().invoke(app, ["sim", "run", "--model", DESIGN, *args])
    assert result.exit_code == 2
    assert says in " ".join(result.output.split())


def test_routing_options_set_the_policys_fields_and_bad_ones_are_refused_by_name():
    from backends.sim.cli import routing_config

    config = routing_config("cache_aware", ["load_cost_tokens=256", "tokenizer=gpt2"])
    assert (config.load_cost_tokens, config.tokenizer) == (256, "gpt2")
    for options, says in ((["load_cost_tokens=-1"], "load_cost_tokens"), (["frobnicate=1"], "frobnicate"),
                          (["load_cost_tokens"], "KEY=VALUE")):
        with pytest.raises(typer.BadParameter, match=says):
            routing_config("cache_aware", options)


def test_sim_run_takes_routing_options():
    from typer.testing import CliRunner

    from gateway.cli import app

    base = ["sim", "run", "--model", DESIGN, "--replicas", "2", "--requests", "4", "--output-len", "2"]
    ok = CliRunner().invoke(app, [*base, "--routing-option", "load_cost_tokens=256"], catch_exceptions=False)
    bad = CliRunner().invoke(app, [*base, "--routing-option", "balance_rel_threshold=0.5"])
    assert ok.exit_code == 0, ok.output
    assert bad.exit_code == 2 and "balance_rel_threshold" in " ".join(bad.output.split())


def test_a_trace_of_prompt_texts_is_refused_naming_what_the_simulator_needs(tmp_path):
    from backends.sim.virtual import trace_workload

    trace = tmp_path / "texts.jsonl"
    trace.write_text('{"timestamp": 0, "prompt": "Hello there", "output_length": 4}\n')
    with pytest.raises(ValueError, match="input_length"):
        trace_workload(trace)
