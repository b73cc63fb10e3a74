"""Public model names → groups of deployments, and the strategies that pick one deployment per request.

Strategies (``routing:`` of a model in the config):
- ``least_outstanding`` (default): fewest requests in flight or queued, per unit of weight.
- ``round_robin``: smooth weighted round-robin (nginx's), so weights 2:1 give A A B, never A A ... B B.
- ``latency``: lowest EWMA time-to-first-token × (outstanding + 1) / weight: the expected wait, so a
  fast backend is preferred until its queue makes it slower than the others.
- ``prefix_affinity``: consistent hashing on the prompt's leading characters, so requests sharing a
  prefix reach the same engine and hit its prefix cache; falls back to least outstanding when the
  chosen deployment is ``balance_threshold`` requests busier than the idlest one (as SGLang's router).
Every strategy sees only deployments that are healthy, whose breaker lets requests through, and that
this request has not already tried.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import random
from collections.abc import Collection
from dataclasses import dataclass, field

from backends.base import GenerationRequest, UnavailableError
from gateway.config import Routing
from gateway.deployments import Deployment


@dataclass
class ModelGroup:
    """The deployments serving one public model name, the strategy choosing among them, and the
    models to fall back to when none of them can answer."""

    name: str
    deployments: list[Deployment]
    routing: Routing = "least_outstanding"
    fallbacks: list[str] = field(default_factory=list)
    prefix_chars: int = 256
    balance_threshold: int = 32

    def __post_init__(self) -> None:
        self._rr_current = {id(d): 0.0 for d in self.deployments}
        self._ring = _HashRing(self.deployments)

    @property
    def ready(self) -> bool:
        return any(d.healthy for d in self.deployments)

    def choose(self, request: GenerationRequest | None = None, exclude: Collection[Deployment] = ()) -> Deployment:
        """The deployment for ``request``; raises ``UnavailableError`` when none is available."""
        candidates = [d for d in self.deployments if d.available and d not in exclude]
        if not candidates:
            raise UnavailableError(f"no healthy backend for model '{self.name}'")
        if len(candidates) == 1:
            return candidates[0]
        if self.routing == "round_robin":
            return self._round_robin(candidates)
        if self.routing == "latency":
            return _least(candidates, lambda d: (d.ttft_ewma_s or 0.0) * (d.outstanding + 1) / d.weight)
        if self.routing == "prefix_affinity" and request is not None:
            return self._prefix_affinity(candidates, request)
        return _least(candidates, lambda d: d.outstanding / d.weight)

    def _round_robin(self, candidates: list[Deployment]) -> Deployment:
        total = 0.0
        for d in candidates:
            self._rr_current[id(d)] += d.weight
            total += d.weight
        best = max(candidates, key=lambda d: self._rr_current[id(d)])
        self._rr_current[id(best)] -= total
        return best

    def _prefix_affinity(self, candidates: list[Deployment], request: GenerationRequest) -> Deployment:
        chosen = self._ring.lookup(prefix_key(request, self.prefix_chars), candidates)
        idlest = min(d.outstanding for d in candidates)
        if chosen.outstanding - idlest > self.balance_threshold:
            return _least(candidates, lambda d: d.outstanding / d.weight)
        return chosen


def _least(candidates: list[Deployment], score) -> Deployment:
    """The lowest-scoring deployment, ties broken at random so equal backends share the load."""
    best = min(score(d) for d in candidates)
    return random.choice([d for d in candidates if score(d) == best])


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
    """Consistent hashing with virtual nodes (64 per unit of weight): removing one deployment moves
    only the prefixes it owned."""

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
