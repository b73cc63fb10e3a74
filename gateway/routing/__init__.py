"""Routing: which deployment of a model serves each request.

A model's deployments form a ``ModelGroup`` (group.py), which hands each request to its policy: one module of
this package per policy, behind one interface (policy.py), chosen by the model's ``routing:`` (a name, or
``policy:`` with that policy's settings):

- ``least_outstanding`` (default): fewest requests in flight or queued, per unit of weight;
- ``round_robin``: smooth weighted round robin;
- ``latency``: lowest expected wait, from the time to first token;
- ``prefix_affinity``: consistent hashing on the prompt's first characters;
- ``cache_aware``: lowest cost counting the prompt's uncached tokens on each replica (prefix_index.py) and the
  replica's load as its engine reports it (engine_load.py), with guards against hot spots.

A conversation's next turn (``Conversation``: the Responses API's ``previous_response_id``) goes to the deployment
that answered the previous one, whatever the policy, while that keeps the load within SGLang's imbalance rule.
Every policy sees only deployments that are healthy, whose breaker lets requests through, and that the request
has not tried already.
"""

from gateway.routing import cache_aware, latency, least_outstanding, prefix_affinity, round_robin  # noqa: F401
from gateway.routing.group import ModelGroup
from gateway.routing.policy import POLICIES, Choice, Conversation, Policy, PolicyConfig, RoutedRequest, register

__all__ = ["POLICIES", "Choice", "Conversation", "ModelGroup", "Policy", "PolicyConfig", "RoutedRequest", "register",
           "routing_config"]


def routing_config():
    """The type of a model's ``routing:``: any registered policy's config, told apart by ``policy``."""
    from typing import Annotated, Union

    from pydantic import Field

    configs = tuple(cls.Config for cls in POLICIES.values())
    return Annotated[Union[configs], Field(discriminator="policy")]  # noqa: UP007 (a tuple of types)
