"""cache_aware routing (gateway/routing/cache_aware.py): a request goes where its prompt costs least, counting the
uncached tokens on each replica and the replica's load; conversations stay with their history, popular prefixes
spread, and the guards hold."""

from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import ValidationError

from backends.base import GenerationRequest, SamplingParams
from backends.http import RemoteConfig
from backends.openai_http import OpenAIHTTPBackend
from gateway.breaker import CircuitBreaker
from gateway.deployments import Deployment
from gateway.limits import ConcurrencyLimiter
from gateway.routing import ModelGroup
from gateway.routing.cache_aware import CacheAwareConfig
from gateway.routing.engine_load import EngineLoad


def deployment(name: str) -> Deployment:
    backend = OpenAIHTTPBackend("m", RemoteConfig(url="http://127.0.0.1:9/v1"))  # never called
    return Deployment(name=name, backend=backend, limiter=ConcurrencyLimiter(1000, 1000),
                      breaker=CircuitBreaker(2, 60.0))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def send(group: ModelGroup, tokens: list[int], user: str | None = None, hold: bool = True):
    """Route a request of ``tokens``; with ``hold`` it stays in flight on its deployment (its load)."""
    choice = asyncio.run(group.route(GenerationRequest("r", "m", SamplingParams(), prompt=tokens, user=user)))
    if hold:
        choice.deployment.limiter.in_flight += 1
    return choice


def group_of(*names: str, **config) -> tuple[ModelGroup, list[Deployment]]:
    ds = [deployment(n) for n in names]
    return ModelGroup("m", ds, routing=CacheAwareConfig(block_size=16, **config)), ds


def test_a_conversations_next_turn_goes_where_its_history_is_cached():
    group, (a, b) = group_of("a", "b")
    history = ids("system: be brief. " * 20)
    first = send(group, history).deployment
    other = b if first is a else a
    other.limiter.in_flight = 0
    first.limiter.in_flight = 1  # busier by one: worth 256 tokens, the history's hit is worth more
    turn = send(group, history + ids(" user: and then? assistant: this."), hold=False)
    assert turn.deployment is first and turn.reason == "prefix_hit"


def test_a_popular_prefix_spreads_instead_of_piling_onto_one_replica():
    group, ds = group_of("a", "b", "c", load_cost_tokens=128)
    system = ids("You are a helpful assistant. " * 36)  # 1044 tokens: worth ~8 requests of load
    for i in range(60):
        send(group, system + ids(f"question {i}?"))
    loads = [d.outstanding for d in ds]
    assert min(loads) > 0 and max(loads) - min(loads) <= len(system) // 128 + 1, loads


def test_the_load_guard_sends_a_request_away_from_a_replica_far_busier_than_the_idlest():
    group, (a, b) = group_of("a", "b", load_cost_tokens=0)  # only the guard can move it
    prompt = ids("a long shared document " * 40)
    holder = send(group, prompt, hold=False).deployment
    other = b if holder is a else a
    holder.limiter.in_flight = 40  # 40 over the idlest, and more than 1.5 x its load
    choice = send(group, prompt, hold=False)
    assert choice.deployment is other and choice.reason == "load_guard"


def test_the_engines_own_load_counts_what_other_gateways_sent():
    group, (a, b) = group_of("a", "b")
    group.policy.loads.loads["a"] = EngineLoad(running=8, waiting=12, kv_usage=0.3, at=time.monotonic())
    group.policy.loads.loads["b"] = EngineLoad(running=1, waiting=0, kv_usage=0.1, at=time.monotonic())
    assert send(group, ids("x" * 40), hold=False).deployment is b
    group.policy.loads.loads["a"] = EngineLoad(running=8, waiting=12, kv_usage=0.3, at=time.monotonic() - 60)
    assert group.policy.load(a) == 0  # stale: three intervals old, this gateway's count alone


def test_a_nearly_full_kv_cache_takes_no_request_while_another_has_room():
    group, (a, b) = group_of("a", "b")
    prompt = ids("cached on a " * 30)
    send(group, prompt, hold=False)
    holder = next(d for d in (a, b) if group.policy.index.size(d.name))
    other = b if holder is a else a
    group.policy.loads.loads[holder.name] = EngineLoad(0, 0, kv_usage=0.99, at=time.monotonic())
    choice = send(group, prompt, hold=False)
    assert choice.deployment is other and choice.reason == "kv_guard"


def test_ties_go_to_the_replica_that_served_the_session_last():
    group, _ = group_of("a", "b")
    firsts = {send(group, ids(f"hello {i}"), user="alice", hold=False).deployment.name for i in range(10)}
    assert len(firsts) == 1  # no cache to tell them apart, equal load: alice stays where she was
    spread = {send(group, ids(f"hello {i}"), hold=False).deployment.name for i in range(40)}
    assert spread == {"a", "b"}  # without a session, ties go either way


def test_a_replica_that_goes_down_is_never_chosen_and_its_conversations_rehome():
    group, _ = group_of("a", "b")
    history = ids("a long conversation so far " * 20)
    first = send(group, history, hold=False).deployment
    first.healthy = False
    again = send(group, history + ids(" next"), hold=False)
    assert again.deployment is not first and again.reason == "only"
    first.healthy = True
    assert send(group, history + ids(" next"), hold=False).reason == "prefix_hit"  # both hold it now


def test_auto_load_cost_is_the_mean_uncached_prompt_of_the_requests_routed_and_follows_the_traffic():
    group, _ = group_of("a", "b", load_cost_tokens="auto")
    learnt = group.policy.load_cost
    assert learnt.tokens == 64  # before any request
    send(group, ids("0000" + "x" * 156), hold=False)
    assert learnt.tokens == pytest.approx((50 * 64 + 160) / 51)  # one cold request does not decide it
    for i in range(1, 1000):  # 160 tokens, nothing shared (each differs in its first block)
        send(group, ids(f"{i:04d}" + "x" * 156), hold=False)
    assert learnt.tokens == pytest.approx(160, rel=0.01)
    for i in range(600):  # the traffic changes: 40-token prompts
        send(group, ids(f"{i:04d}" + "y" * 36), hold=False)
    assert 40 < learnt.tokens < 50  # the latest few hundred weigh most


def test_a_learnt_rate_moves_a_conversation_off_a_busy_replica_sooner_than_a_low_fixed_one():
    """Where each request brings 160 uncached tokens, one request of load is worth more than 64: a replica three
    requests busier loses a 256-token history to an idle one under ``auto``, keeps it at 64."""
    history = ids("system: be brief. " * 14)[:256]
    turn = history + ids(" user: and then?")
    for setting, stays in (("auto", False), (64.0, True)):
        group, (a, b) = group_of("a", "b", load_cost_tokens=setting)
        for i in range(100):
            send(group, ids(f"{i:04d}" + "x" * 156), hold=False)
        first = send(group, history, hold=False).deployment
        other = b if first is a else a
        first.limiter.in_flight, other.limiter.in_flight = 3, 0
        assert (send(group, turn, hold=False).deployment is first) == stays, setting


def test_load_cost_tokens_takes_a_number_or_auto():
    with pytest.raises(ValidationError, match="load_cost_tokens"):
        CacheAwareConfig(load_cost_tokens="fast")
    with pytest.raises(ValidationError, match="load_cost_tokens"):
        CacheAwareConfig(load_cost_tokens=-1)


def test_auto_load_cost_learns_from_every_request_routed_and_keeps_a_floor():
    group, _ = group_of("only", load_cost_tokens="auto")  # one candidate: routed without a choice
    for i in range(20):
        send(group, ids(f"{i:04d}" + "x" * 156), hold=False)
    assert group.policy.load_cost.tokens == pytest.approx((50 * 64 + 20 * 160) / 70)
    prompt = ids("cached " * 40)
    for _ in range(2000):  # the same prompt again and again: all but its last partial block cached
        send(group, prompt, hold=False)
    assert group.policy.load_cost.tokens == 16  # the floor: load still counts
