"""The one interface every routing policy implements, and the registry of policies by name.

A policy sees the deployments that may take a request (healthy, breaker closed, not tried yet by this request),
the request itself (with its token ids where the policy asks for them), and chooses one; it hears of each
dispatch afterwards (``dispatched``), which is where an index of what each engine holds is updated. Each
policy is one module of this package with its own config model (the ``routing:`` of a model in the
config: a name, or a mapping with ``policy:`` and that policy's fields), registered with ``@register``:
adding a policy is one file and its test.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from backends.base import GenerationRequest
    from gateway.deployments import Deployment


class PolicyConfig(BaseModel):
    """A policy's settings; each policy subclasses it with ``policy: Literal["<its name>"]`` and its fields."""

    model_config = ConfigDict(extra="forbid")
    policy: str


@dataclass
class RoutedRequest:
    """What a policy sees of a request: the request, and for policies that ask for them (``needs_tokens``) its
    token ids as the engine will see them (a chat rendered through the model's template), with how they were
    counted."""

    request: GenerationRequest
    tokens: list[int] | None = None
    tokens_source: str | None = None  # "engine", "tokenizer", "server" or "characters"
    session: str | None = None  # OpenAI's ``user`` or the session header: a tie-breaker for sticky policies
    notes: dict[str, Any] = field(default_factory=dict)  # what the policy measured, for its dispatch hook


@dataclass
class Conversation:
    """A request's place in a conversation the gateway keeps (the Responses API's stored turns): ``held_by`` names
    the deployment that answered the previous turn, whose KV cache holds the history (preferred when the load
    guard allows), ``session`` keys sticky ties (``prompt_cache_key``); the gateway writes ``served_by``."""

    held_by: str | None = None
    session: str | None = None
    served_by: str | None = None


@dataclass(frozen=True)
class Choice:
    """The deployment a policy chose and why (a label of burstgate:routing_decisions_total), with the request as
    the policy saw it (for ``ModelGroup.finished``)."""

    deployment: Deployment
    reason: str
    routed: RoutedRequest | None = None


class Policy(abc.ABC):
    """Chooses one of a model group's available deployments for each request."""

    name: ClassVar[str]
    Config: ClassVar[type[PolicyConfig]]
    needs_tokens: ClassVar[bool] = False  # the group tokenizes requests for it (RoutedRequest.tokens)

    def __init__(self, config: PolicyConfig, deployments: list[Deployment]) -> None:
        self.config = config
        self.deployments = deployments

    @abc.abstractmethod
    def choose(self, candidates: list[Deployment], request: RoutedRequest) -> Choice:
        """One of ``candidates`` (never empty; more than one) for ``request``."""

    def dispatched(self, deployment: Deployment, request: RoutedRequest) -> None:  # noqa: B027 (a hook)
        """``deployment`` took ``request`` (called for every dispatch, also when no choice was needed)."""

    def finished(self, deployment: Deployment, request: RoutedRequest, tokens: list[int]) -> None:  # noqa: B027
        """``deployment`` answered ``request``: ``tokens`` are its prompt's and its answer's, as the engine holds
        them now (what a next turn of the conversation begins with)."""

    def joined(self, deployment: Deployment) -> list[Callable[[], Any]]:
        """``deployment`` (a discovered replica) takes requests from now on; returns the coroutine functions to run
        for it while it stays (as ``background``'s, but for it alone)."""
        return []

    def forget(self, deployment: Deployment) -> None:  # noqa: B027 (a hook)
        """``deployment`` left (a replica gone), or went down (its engine may come back empty): forget what was
        kept about what it holds."""

    def load(self, deployment: Deployment) -> float:
        """Requests ``deployment`` runs and queues per unit of weight, as this policy sees them (this gateway's own
        in-flight count unless the policy reads the engines')."""
        return deployment.outstanding / deployment.weight

    def balanced(self, deployment: Deployment, candidates: list[Deployment]) -> bool:
        """Whether sending one more request to ``deployment`` keeps the load within SGLang's imbalance rule: not
        more than ``balance_abs_threshold`` requests over the idlest candidate and ``balance_rel_threshold`` times
        its load (the policy's settings where it has them, else SGLang's defaults)."""
        loads = [self.load(d) for d in candidates]
        mine, idlest = self.load(deployment), min(loads)
        limit_abs = getattr(self.config, "balance_abs_threshold", BALANCE_ABS_THRESHOLD)
        limit_rel = getattr(self.config, "balance_rel_threshold", BALANCE_REL_THRESHOLD)
        return not (mine - idlest > limit_abs and mine > limit_rel * idlest)

    def index_blocks(self, deployment: Deployment) -> int | None:
        """KV blocks the policy's index says ``deployment`` holds (None: the policy keeps no index)."""
        return None

    def index_precise(self, deployment: Deployment) -> bool | None:
        """Whether that index follows ``deployment``'s engine's KV events now (None: no index)."""
        return None

    def load_cost_tokens(self) -> float | None:
        """Uncached prompt tokens the policy weighs one request of load against now (None: it weighs none)."""
        return None

    def background(self) -> list[Callable[[], Any]]:
        """Coroutine functions the gateway runs for as long as it serves (scrapers, event subscribers)."""
        return []


BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD = 32, 1.5  # SGLang's router's defaults
POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: ``cls`` serves ``routing: <cls.name>``."""
    POLICIES[cls.name] = cls
    return cls


def least_loaded(candidates: list[Deployment], score: Callable[[Deployment], Any]) -> Deployment:
    """The lowest-scoring deployment, ties broken at random so that equal backends share the load."""
    best = min(score(d) for d in candidates)
    return random.choice([d for d in candidates if score(d) == best])
