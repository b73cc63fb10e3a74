"""``cache_aware``: each request to the deployment where it costs least, counting what the engine must prefill
and how loaded it is; guards keep a popular prefix from piling onto one replica.

For every healthy candidate ``d`` the cost of sending a prompt of ``n`` tokens there is

    cost(d) = (n - cached(d)) + load_cost_tokens x load(d)

``cached(d)``: the tokens of the prompt's leading full blocks that ``d`` holds (prefix_index.py: from this
gateway's own routing, and where a deployment names its engine's KV events (``kv_events:``) precisely from
them: blocks stored and evicted; when they stop, the index is the gateway's own again); ``load(d)``: the requests ``d`` runs and
queues, as its engine reports them (engine_load.py; every gateway replica reads the same) or, where that is
stale or missing, this gateway's own in-flight count, whichever is larger (a dispatch the engine has not
reported yet still counts). So a prefix hit of ``k`` tokens is worth ``k / load_cost_tokens`` requests of load:
a conversation stays where its history is until that replica is that much busier than another, then moves (and
the replica it moves to holds its history from then on: affinity is never dropped for good).

``load_cost_tokens`` is an exchange rate between prefill and queueing that depends on the hardware and the traffic.
``auto`` learns it: a request ahead of a new one delays it by about its own prefill, so one request of load is worth
the uncached prompt tokens of the requests routed (their mean, the last few hundred weighing most), starting from 64
as if 50 requests had brought that many: a burst's first requests, which find no cache anywhere, do not decide it.

Guards, before the costs:
- imbalance (SGLang's ``balance_abs_threshold`` / ``balance_rel_threshold``): when the busiest candidate has more
  than ``balance_abs_threshold`` requests over the idlest and more than ``balance_rel_threshold`` times its load,
  only the candidates within ``balance_abs_threshold`` of the idlest stay;
- a KV cache fuller than ``kv_high_watermark`` takes no new request while another candidate is below it.
Ties (costs within ``tie_tokens``) go to the deployment that served the request's session last (OpenAI's
``user``), else to the least loaded, the one holding more of the prompt, then at random.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from backends.kv_events import BlockRemoved, BlockStored, follow
from backends.native.block_hash import block_hashes
from gateway.routing.engine_load import LoadReader
from gateway.routing.policy import Choice, Policy, PolicyConfig, RoutedRequest, least_loaded, register
from gateway.routing.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from gateway.deployments import Deployment

log = logging.getLogger(__name__)

SESSIONS = 100_000  # sessions remembered for ties, least recently seen dropped first


class CacheAwareConfig(PolicyConfig):
    policy: Literal["cache_aware"] = "cache_aware"
    # tokens per KV block of the engines (vLLM's --block-size); None: the native engine's own, else 16
    block_size: int | None = Field(None, ge=1)
    # local HF directory or .gguf whose tokenizer is the engines' (remote deployments); None: an in-process
    # engine's, else the first deployment's /tokenize; without either, prompts are cut into characters
    tokenizer: str | None = None
    # uncached prompt tokens one running or queued request is worth: an exchange rate between prefill and queueing
    # that depends on the hardware and the traffic (docs/routing.md: 64 led on CPU replicas; on simulated H100
    # fleets 256, and "auto", which learns it from the traffic, tied the best fixed rate at every size)
    load_cost_tokens: Annotated[float, Field(ge=0)] | Literal["auto"] = 64.0
    # the imbalance guard (SGLang's): when the busiest candidate runs more than balance_abs_threshold requests over
    # the idlest and more than balance_rel_threshold times its load, only those within the threshold stay
    balance_abs_threshold: int = Field(32, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)  # see balance_abs_threshold
    kv_high_watermark: float = Field(0.95, gt=0, le=1)  # a KV cache fuller than this takes nothing while another has room
    tie_tokens: float = Field(16.0, ge=0)  # costs within this are ties: the session's last deployment wins
    index_blocks: int = Field(200_000, ge=1)  # blocks remembered per deployment (LRU)
    load_interval_s: float = Field(1.0, gt=0)  # how often the engines' /metrics are read
    events_timeout_s: float = Field(30.0, gt=0)  # KV events older than this: the index counts as approximate


@register
class CacheAware(Policy):
    name = "cache_aware"
    Config = CacheAwareConfig
    config: CacheAwareConfig
    needs_tokens = True

    def __init__(self, config: CacheAwareConfig, deployments: list[Deployment]) -> None:
        super().__init__(config, deployments)
        self.index = PrefixIndex(config.index_blocks)
        self.loads = LoadReader(deployments, config.load_interval_s)
        self._block_size = config.block_size
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session -> deployment name
        self.events_at: dict[str, float] = {}  # deployment name -> when its last KV events arrived
        self.load_cost = LoadCost(config.load_cost_tokens)

    def background(self):
        followed = [d for d in self.deployments if getattr(d.config, "kv_events", None)]
        return [self.loads.run, *(functools.partial(self._follow, d) for d in followed)]

    def joined(self, deployment: Deployment) -> list:
        return [functools.partial(self._follow, deployment)] if getattr(deployment.config, "kv_events", None) else []

    def forget(self, deployment: Deployment) -> None:
        """A replica gone or down: its blocks leave the index (it comes back with an empty cache)."""
        self.index.cleared(deployment.name)
        self.events_at.pop(deployment.name, None)
        self.loads.forget(deployment)

    async def _follow(self, d: Deployment) -> None:
        """Keep ``d``'s index precise from its engine's KV events, for as long as the gateway serves."""
        def apply(events: list) -> None:
            self.events_at[d.name] = time.monotonic()
            for event in events:
                if isinstance(event, BlockStored):
                    self.index.stored(d.name, event.block_hashes, event.parent_block_hash, event.token_ids,
                                      event.block_size)
                elif isinstance(event, BlockRemoved):
                    self.index.removed(d.name, event.block_hashes)
                else:
                    self.index.cleared(d.name)

        def gap(missed: int) -> None:
            log.warning("KV events of %s: %d batches missed; its index may keep blocks the engine dropped", d.name,
                        missed)

        def restart() -> None:
            log.warning("KV events of %s begin again: its engine restarted, its index is emptied", d.name)
            self.index.cleared(d.name)

        await follow(d.config.kv_events, d.config.kv_events_topic, apply, gap, restart)

    def index_precise(self, deployment: Deployment) -> bool:
        """Whether the deployment's index follows its engine's KV events (a batch within the last
        ``events_timeout_s``); else it is kept from this gateway's own decisions alone."""
        at = self.events_at.get(deployment.name)
        return at is not None and time.monotonic() - at < self.config.events_timeout_s

    @property
    def block_size(self) -> int:
        """The configured block size, else an in-process engine's (known once it started), else vLLM's 16."""
        if self._block_size is None:
            self._block_size = _engine_block_size(self.deployments)
        return self._block_size or 16

    def finished(self, deployment: Deployment, request: RoutedRequest, tokens: list[int]) -> None:
        self.index.record(deployment.name, block_hashes(tokens, self.block_size))  # the answer's blocks too

    def index_blocks(self, deployment: Deployment) -> int:
        return self.index.size(deployment.name)

    def load_cost_tokens(self) -> float:
        return self.load_cost.tokens

    def load(self, d: Deployment) -> float:
        """Requests ``d`` runs and queues: the engine's figure or this gateway's in-flight count, the larger."""
        engine = self.loads.load(d)
        reported = engine.running + engine.waiting if engine is not None else 0.0
        return max(reported, float(d.outstanding)) / d.weight

    def choose(self, candidates: list[Deployment], request: RoutedRequest) -> Choice:
        reason = None
        loads = {d.name: self.load(d) for d in candidates}
        idlest, busiest = min(loads.values()), max(loads.values())
        cfg = self.config
        if busiest - idlest > cfg.balance_abs_threshold and busiest > cfg.balance_rel_threshold * idlest:
            candidates = [d for d in candidates if loads[d.name] <= idlest + cfg.balance_abs_threshold]
            reason = "load_guard"
        roomy = [d for d in candidates if (load := self.loads.load(d)) is None or load.kv_usage < cfg.kv_high_watermark]
        if roomy and len(roomy) < len(candidates):
            candidates, reason = roomy, reason or "kv_guard"
        tokens = request.tokens or []
        keys = request.notes["keys"] = block_hashes(tokens, self.block_size)
        cached = {d.name: self.index.match(d.name, keys) * self.block_size for d in candidates}
        load_cost = self.load_cost.tokens
        cost = {d.name: len(tokens) - cached[d.name] + load_cost * loads[d.name] for d in candidates}
        best = min(cost.values())
        tied = [d for d in candidates if cost[d.name] <= best + cfg.tie_tokens]
        sticky = self._sessions.get(request.session) if request.session else None
        chosen = next((d for d in tied if d.name == sticky), None) or least_loaded(
            tied, lambda d: (loads[d.name], -cached[d.name]))
        if reason is None:
            reason = "prefix_hit" if cached[chosen.name] else "no_prefix" if keys else "no_tokens"
        request.notes["cached"] = (chosen.name, cached[chosen.name])  # for dispatched: no second index lookup
        return Choice(chosen, reason)

    def _cached(self, deployment: Deployment, request: RoutedRequest, keys: list) -> int:
        """The prompt tokens ``deployment`` holds: as ``choose`` counted them, or (routed without a choice) now."""
        name, cached = request.notes.get("cached", (None, 0))
        return cached if name == deployment.name else self.index.match(deployment.name, keys) * self.block_size

    def dispatched(self, deployment: Deployment, request: RoutedRequest) -> None:
        keys = request.notes.get("keys")
        if keys is None and request.tokens:
            keys = block_hashes(request.tokens, self.block_size)
        if keys:
            if self.load_cost.learns and request.tokens:  # every request routed, whichever path chose its replica
                self.load_cost.observe(len(request.tokens) - self._cached(deployment, request, keys))
            self.index.record(deployment.name, keys)  # approximate: its prefill will leave them there
        if request.session:
            self._sessions[request.session] = deployment.name
            self._sessions.move_to_end(request.session)
            while len(self._sessions) > SESSIONS:
                self._sessions.popitem(last=False)


class LoadCost:
    """Uncached prompt tokens one request of load is worth: the configured number, or for ``auto`` the mean of the
    uncached prompt tokens of the requests routed so far, after ``AUTO_PRIOR`` requests of ``AUTO_START`` tokens:
    exact up to ``1 / AUTO_WEIGHT`` requests in all, then weighted towards the latest (traffic changes)."""

    AUTO_START = 64.0  # the default for fixed rates
    AUTO_PRIOR = 50  # requests' worth of weight the start keeps
    AUTO_WEIGHT = 0.005  # the weight of each new request once past the first 150 (200 with the prior's 50)
    AUTO_FLOOR = 16.0  # tokens: on traffic served almost wholly from cache, load still counts

    def __init__(self, setting: float | Literal["auto"]) -> None:
        self.fixed = None if setting == "auto" else float(setting)
        self.mean, self.seen = self.AUTO_START, self.AUTO_PRIOR

    @property
    def learns(self) -> bool:
        """Whether the rate is learnt (``auto``)."""
        return self.fixed is None

    @property
    def tokens(self) -> float:
        """The exchange rate now."""
        return max(self.mean, self.AUTO_FLOOR) if self.fixed is None else self.fixed

    def observe(self, uncached: int) -> None:
        """A request routed with ``uncached`` prompt tokens to prefill where it went."""
        if self.fixed is None:
            self.seen += 1
            self.mean += max(1 / self.seen, self.AUTO_WEIGHT) * (uncached - self.mean)


def _engine_block_size(deployments: list[Deployment]) -> int | None:
    """The KV block size of an in-process native engine among ``deployments`` (once started), if any."""
    for d in deployments:
        engine = getattr(d.backend, "engine", None)
        if engine is not None and d.backend.stats() is not None:  # in process, and started
            return engine.blocks.block_size
    return None
