"""``latency``: the lowest expected wait, EWMA time to first token x (outstanding + 1) / weight, so that a fast
backend is preferred until its queue makes it slower than the others."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from gateway.routing.policy import Choice, Policy, PolicyConfig, RoutedRequest, least_loaded, register

if TYPE_CHECKING:
    from gateway.deployments import Deployment


class LatencyConfig(PolicyConfig):
    policy: Literal["latency"] = "latency"


@register
class Latency(Policy):
    name = "latency"
    Config = LatencyConfig
    config: LatencyConfig

    def choose(self, candidates: list[Deployment], request: RoutedRequest) -> Choice:
        return Choice(least_loaded(candidates, lambda d: (d.ttft_ewma_s or 0.0) * (d.outstanding + 1) / d.weight),
                      "latency")
