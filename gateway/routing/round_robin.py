"""``round_robin``: smooth weighted round robin (nginx's), so that weights 2:1 give A A B, never A A ... B B."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from gateway.routing.policy import Choice, Policy, PolicyConfig, RoutedRequest, register

if TYPE_CHECKING:
    from gateway.deployments import Deployment


class RoundRobinConfig(PolicyConfig):
    policy: Literal["round_robin"] = "round_robin"


@register
class RoundRobin(Policy):
    name = "round_robin"
    Config = RoundRobinConfig
    config: RoundRobinConfig

    def __init__(self, config: RoundRobinConfig, deployments: list[Deployment]) -> None:
        super().__init__(config, deployments)
        self._current = {id(d): 0.0 for d in deployments}

    def joined(self, deployment: Deployment) -> list:
        self._current[id(deployment)] = 0.0
        return []

    def forget(self, deployment: Deployment) -> None:
        if deployment not in self.deployments:  # down is not gone: it keeps its turn
            self._current.pop(id(deployment), None)

    def choose(self, candidates: list[Deployment], request: RoutedRequest) -> Choice:
        total = 0.0
        for d in candidates:
            self._current[id(d)] += d.weight
            total += d.weight
        best = max(candidates, key=lambda d: self._current[id(d)])
        self._current[id(best)] -= total
        return Choice(best, "round_robin")
