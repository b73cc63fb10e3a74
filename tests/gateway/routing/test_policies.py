"""The policies that need no index choose among available deployments as their modules say (gateway/routing/),
and no registered policy ever chooses a deployment that may not take the request."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from backends.base import GenerationRequest, SamplingParams, UnavailableError
from backends.http import RemoteConfig
from backends.openai_http import OpenAIHTTPBackend
from gateway.breaker import CircuitBreaker
from gateway.deployments import Deployment
from gateway.limits import ConcurrencyLimiter
from gateway.routing import POLICIES, ModelGroup
from gateway.routing.latency import LatencyConfig
from gateway.routing.policy import PolicyConfig
from gateway.routing.prefix_affinity import PrefixAffinityConfig
from gateway.routing.round_robin import RoundRobinConfig


def deployment(name: str, weight: float = 1.0, in_flight: int = 0) -> Deployment:
    # A real adapter that is never called: routing looks only at the deployment's own state.
    backend = OpenAIHTTPBackend("m", RemoteConfig(url="http://127.0.0.1:9/v1"))
    d = Deployment(name=name, backend=backend, weight=weight, limiter=ConcurrencyLimiter(8, 8),
                   breaker=CircuitBreaker(2, 60.0))
    d.limiter.in_flight = in_flight
    return d


def request(prompt: str, prompt_ids: bool = False) -> GenerationRequest:
    """A completion of ``prompt`` (as character codes with ``prompt_ids``: token ids no tokenizer has to make)."""
    return GenerationRequest("r", "m", SamplingParams(), prompt=[ord(c) for c in prompt] if prompt_ids else prompt)


def test_round_robin_is_smooth_and_weighted():
    a, b = deployment("a", weight=2), deployment("b")
    group = ModelGroup("m", [a, b], routing=RoundRobinConfig())
    picks = [group.choose(request("p")).name for _ in range(9)]
    assert picks == ["a", "b", "a"] * 3


def test_least_outstanding_prefers_the_idlest_per_unit_of_weight():
    busy, idle, big = deployment("busy", in_flight=3), deployment("idle", in_flight=1), deployment("big", 4, 3)
    group = ModelGroup("m", [busy, idle, big])
    assert group.choose(request("p")) is big  # 3/4 < 1/1 < 3/1


def test_latency_prefers_the_faster_backend_until_its_queue_makes_it_slower():
    fast, slow = deployment("fast"), deployment("slow")
    for _ in range(20):
        fast.observe_ttft(0.1)
        slow.observe_ttft(0.5)
    group = ModelGroup("m", [fast, slow], routing=LatencyConfig())
    assert group.choose(request("p")) is fast
    fast.limiter.in_flight = 9  # expected wait 0.1 × 10 = 1.0 s > 0.5 s
    assert group.choose(request("p")) is slow


def test_ewma_moves_towards_new_observations():
    d = deployment("d")
    d.observe_ttft(1.0)
    d.observe_ttft(0.0)
    assert d.ttft_ewma_s == pytest.approx(0.8)


def test_prefix_affinity_sends_a_shared_prefix_to_one_deployment_and_spreads_the_rest():
    ds = [deployment(f"d{i}") for i in range(3)]
    group = ModelGroup("m", ds, routing=PrefixAffinityConfig(prefix_chars=32))
    system = "You are a terse assistant. " * 3
    owners = {group.choose(request(system + f"question {i}")).name for i in range(50)}
    assert len(owners) == 1
    spread = Counter(group.choose(request(f"{i} unrelated prompt")).name for i in range(300))
    assert set(spread) == {"d0", "d1", "d2"} and min(spread.values()) > 50


def test_prefix_affinity_moves_only_the_prefixes_of_a_removed_deployment():
    ds = [deployment(f"d{i}") for i in range(4)]
    group = ModelGroup("m", ds, routing=PrefixAffinityConfig())
    prompts = [f"prompt {i}" for i in range(400)]
    before = {p: group.choose(request(p)) for p in prompts}
    ds[1].healthy = False
    after = {p: group.choose(request(p)) for p in prompts}
    moved = [p for p in prompts if before[p] is not after[p]]
    assert moved and all(before[p] is ds[1] for p in moved)


def test_prefix_affinity_yields_to_load_balance_when_the_owner_is_far_busier():
    a, b = deployment("a"), deployment("b")
    group = ModelGroup("m", [a, b], routing=PrefixAffinityConfig(balance_threshold=4))
    owner = group.choose(request("same prefix"))
    other = b if owner is a else a
    owner.limiter.in_flight = 5
    assert group.choose(request("same prefix")) is other


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_no_policy_chooses_an_unhealthy_open_or_excluded_deployment(policy):
    sick, broken, tried, good = (deployment(n) for n in ("sick", "broken", "tried", "good"))
    sick.healthy = False
    broken.breaker.failure()
    broken.breaker.failure()  # threshold 2: open for 60 s
    config: PolicyConfig = POLICIES[policy].Config()
    group = ModelGroup("m", [sick, broken, tried, good], routing=config)

    async def routed():
        choices = [await group.route(request(f"p{i}", prompt_ids=True), exclude=[tried]) for i in range(40)]
        with pytest.raises(UnavailableError, match="no healthy backend for model 'm'"):
            await group.route(request("p", prompt_ids=True), exclude=[tried, good])
        return {c.deployment.name for c in choices}

    assert asyncio.run(routed()) == {"good"}
    assert {group.choose(request(f"p{i}"), exclude=[tried]).name for i in range(40)} == {"good"}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_replica_that_joins_takes_requests_and_one_that_leaves_never_again(policy):
    """Discovered replicas come and go (gateway/discovery/): every policy routes to one that joined and forgets one
    that left, whatever it kept about it."""
    a, b, c = deployment("a"), deployment("b"), deployment("c")
    group = ModelGroup("m", [a, b], routing=POLICIES[policy].Config(policy=policy))
    assert group.join(c) == []  # no KV events configured: no job to run for it
    prompts = [request(f"prompt {i} " * 20, prompt_ids=True) for i in range(60)]
    assert c in {asyncio.run(group.route(p)).deployment for p in prompts}
    group.leave(a)
    assert a not in {asyncio.run(group.route(p)).deployment for p in prompts}
    if (blocks := group.policy.index_blocks(a)) is not None:
        assert blocks == 0  # its prefix index is gone with it
