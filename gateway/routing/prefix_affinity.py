"""``prefix_affinity``: consistent hashing on the prompt's leading characters, so that requests sharing a prefix
reach the same engine and hit its prefix cache; least outstanding instead when the chosen deployment is
``balance_threshold`` requests busier than the idlest one (SGLang's router's balance check). Cheap and
tokenizer-free, but a long shared system prompt sends every conversation to one replica: ``cache_aware`` is
the policy that weighs cache and load."""

from __future__ import annotations

import bisect
import hashlib
import json
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from gateway.routing.policy import Choice, Policy, PolicyConfig, RoutedRequest, least_loaded, register

if TYPE_CHECKING:
    from backends.base import GenerationRequest
    from gateway.deployments import Deployment


class PrefixAffinityConfig(PolicyConfig):
    policy: Literal["prefix_affinity"] = "prefix_affinity"
    prefix_chars: int = Field(256, ge=1)  # leading characters of the prompt that pick the deployment
    balance_threshold: int = Field(32, ge=0)  # outstanding requests above the idlest that give up the affinity


@register
class PrefixAffinity(Policy):
    name = "prefix_affinity"
    Config = PrefixAffinityConfig
    config: PrefixAffinityConfig

    def __init__(self, config: PrefixAffinityConfig, deployments: list[Deployment]) -> None:
        super().__init__(config, deployments)
        self._ring = _HashRing(deployments)

    def joined(self, deployment: Deployment) -> list:
        self._ring = _HashRing(self.deployments)  # consistent: only the prefixes it now owns move to it
        return []

    def forget(self, deployment: Deployment) -> None:
        self._ring = _HashRing(self.deployments)

    def choose(self, candidates: list[Deployment], request: RoutedRequest) -> Choice:
        chosen = self._ring.lookup(prefix_key(request.request, self.config.prefix_chars), candidates)
        idlest = min(d.outstanding for d in candidates)
        if chosen.outstanding - idlest > self.config.balance_threshold:
            return Choice(least_loaded(candidates, lambda d: d.outstanding / d.weight), "load_guard")
        return Choice(chosen, "prefix_hash")


def prefix_key(request: GenerationRequest, chars: int) -> bytes:
    """The leading part of the prompt that decides prefix affinity (text, token ids or chat messages)."""
    if request.messages is not None:
        text = json.dumps(request.messages, sort_keys=True, ensure_ascii=False)
    elif isinstance(request.prompt, list):
        text = ",".join(map(str, request.prompt[: chars // 4]))  # ~4 characters per token
    else:
        text = request.prompt or ""
    return text[:chars].encode()


class _HashRing:
    """Consistent hashing with virtual nodes (64 per unit of weight): removing one deployment moves only the
    prefixes it owned."""

    VNODES = 64

    def __init__(self, deployments: list[Deployment]) -> None:
        points = []
        for d in deployments:
            for i in range(max(1, round(self.VNODES * d.weight))):
                points.append((_hash(f"{d.name}#{i}".encode()), d))
        points.sort(key=lambda p: p[0])
        self._keys = [p[0] for p in points]
        self._owners = [p[1] for p in points]

    def lookup(self, key: bytes, candidates: list[Deployment]) -> Deployment:
        allowed = set(map(id, candidates))
        start = bisect.bisect(self._keys, _hash(key))
        for i in range(len(self._owners)):
            owner = self._owners[(start + i) % len(self._owners)]
            if id(owner) in allowed:
                return owner
        return candidates[0]


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
