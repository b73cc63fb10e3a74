"""``least_outstanding`` (the default): the fewest requests this gateway has in flight or queued on a deployment,
per unit of its weight."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from gateway.routing.policy import Choice, Policy, PolicyConfig, RoutedRequest, least_loaded, register

if TYPE_CHECKING:
    from gateway.deployments import Deployment


class LeastOutstandingConfig(PolicyConfig):
    policy: Literal["least_outstanding"] = "least_outstanding"


@register
class LeastOutstanding(Policy):
    name = "least_outstanding"
    Config = LeastOutstandingConfig
    config: LeastOutstandingConfig

    def choose(self, candidates: list[Deployment], request: RoutedRequest) -> Choice:
        return Choice(least_loaded(candidates, lambda d: d.outstanding / d.weight), "least_outstanding")
