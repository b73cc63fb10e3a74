"""A fleet of simulated replicas on a virtual clock: the native engine's own scheduler and block manager in each
(``runner.py``'s model-free runner, not sleeping), the gateway's own routing policies choosing among them, and
the load tester's metrics over what a client would have seen; no HTTP, no threads, so hours of a fleet's
traffic take what their scheduling work takes on the host.

Events are request sends, arrivals and step ends. A sent request passes the front end (HTTP, the gateway,
tokenizing), one request at a time as an asyncio front end in one process serves them, then arrives at its
replica. A replica that has work starts a step at once: the engine schedules it and the runner gives its modelled
seconds; the step's tokens are delivered when it ends, and requests that arrived meanwhile join the next step, as
on a device that runs one step at a time. Times are seconds since the first arrival.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from backends.base import Backend, EngineStats, GenerationRequest, InvalidRequestError, SamplingParams
from backends.kv_events import BlockRemoved, BlockStored
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine
from backends.sim.runner import SimulatedRunner
from backends.tokenizer import Tokenizer
from gateway.deployments import Deployment
from gateway.limits import ConcurrencyLimiter
from gateway.routing.policy import POLICIES, PolicyConfig, RoutedRequest
from loadtest.metrics import RequestRecord, summarize

# Token ids of generated prompts: ordinary tokens of the embedded tokenizer's range, clear of its special ones
PROMPT_TOKEN_RANGE = (1000, 40000)


@dataclass
class SimRequest:
    """One request of a simulated workload: token ids, not text; a turn of a conversation names it."""

    at_s: float
    prompt: list[int]
    max_tokens: int
    session: str | None = None
    next_turn: SimTurn | None = None  # sent when this one is answered


@dataclass
class SimTurn:
    """The turn after an answer: the conversation so far + the answer + ``question``, ``think_s`` later. A served
    chat sends the answer back as text, re-rendered: past ``kept`` tokens the history comes back as other tokens
    of the same count (an answer run past its end-of-turn token, as with ``ignore_eos``, loses that token in the
    text, and the prefix cache misses from there)."""

    question: list[int]
    max_tokens: int
    think_s: float
    next_turn: SimTurn | None = None
    kept: int | None = None  # tokens of the conversation so far that come back as they were; None: all of them


class _Replica:
    """A simulated engine behind a ``Deployment``, as the gateway's policies see an in-process engine."""

    def __init__(self, name: str, engine: LLMEngine, max_concurrency: int) -> None:
        self.engine = engine
        backend = cast("Backend", self)  # what the policies ask of a backend: stats(), engine
        self.deployment = Deployment(name=name, backend=backend, limiter=ConcurrencyLimiter(max_concurrency, 10**9))
        self.busy = False
        engine.blocks.events = []  # its prefix cache's KV events, for a cache-aware policy's index

    def stats(self) -> EngineStats:  # what LoadReader reads of an in-process engine
        return self.engine.stats()


@dataclass
class _Flight:
    request: SimRequest
    record: RequestRecord
    replica: _Replica
    routed: RoutedRequest
    output: list[int] = field(default_factory=list)


@dataclass
class FleetResult:
    """What a simulated run measured: the load tester's summary, and per replica its share of the work."""

    summary: dict
    records: list[RequestRecord]
    per_replica: dict[str, dict]
    steps: int
    virtual_s: float


class VirtualFleet:
    """``replicas`` simulated engines of ``engine``'s configuration (its ``simulate`` profile, not sleeping),
    routed by ``routing`` (a policy config of the gateway's). ``frontend_s``: the front end's time per request from
    a client's send to its engine's queue (HTTP, the gateway, tokenizing), one request at a time; 0 for an ideal
    front end. With ``frontend_shares_host`` (a CPU engine on the front end's host), a step waits out the front
    end's work queued when it starts: the engine's threads meet at every layer, and one whose core the front end
    takes holds up the others. ``kv_events``: a cache-aware policy's index follows the engines' KV events (precise), else
    only its own routing decisions (approximate). ``seed``: the policies' tie-breaks, re-rendered histories' tokens,
    and (with the engine's own ``simulate.seed``) each replica's draws from its profile's step spread."""

    def __init__(self, engine: EngineConfig, replicas: int, routing: PolicyConfig, tokenizer: Tokenizer | None = None,
                 max_concurrency: int = 1024, seed: int = 0, frontend_s: float = 0.0, frontend_shares_host: bool = False,
                 kv_events: bool = True) -> None:
        self.frontend_s, self.frontend_shares_host, self.kv_events = frontend_s, frontend_shares_host, kv_events
        if engine.simulate is None:
            raise ValueError("a virtual fleet runs simulated replicas: the engine config needs `simulate`")
        configs = [engine.model_copy(update={"warmup": False, "simulate": engine.simulate.model_copy(update={
            "real_time": False, "seed": random.Random(f"{seed}/{engine.simulate.seed}/{i}").getrandbits(64)})})
            for i in range(replicas)]  # each replica draws its steps' spread from its own stream
        first = LLMEngine(configs[0], tokenizer)
        engines = [first] + [LLMEngine(config, first.tokenizer) for config in configs[1:]]
        self.replicas = [_Replica(f"replica-{i}", e, max_concurrency) for i, e in enumerate(engines)]
        deployments = [r.deployment for r in self.replicas]
        self.policy = POLICIES[routing.policy](routing, deployments)
        self._by_deployment = {id(r.deployment): r for r in self.replicas}
        random.seed(seed)  # the policies break ties at random
        self._rng = random.Random(seed)  # re-rendered histories' tokens

    def run(self, requests: list[SimRequest]) -> FleetResult:
        """Serve ``requests`` (and the turns they lead to) to the end; the client's view of each."""
        clock = 0.0
        events: list[tuple[float, int, str, Any]] = []
        order = itertools.count()
        flights: dict[str, _Flight] = {}
        records: list[RequestRecord] = []
        steps = 0
        frontend_free = 0.0  # when the front end has passed every request sent so far

        def push(at: float, kind: str, payload: Any, key: int | None = None) -> None:
            heapq.heappush(events, (at, next(order) if key is None else key, kind, payload))

        def send(at: float, request: SimRequest, key: int | None = None) -> None:
            """``request`` into the front end's queue at ``at``: now, or as an event when the clock gets there. Its
            arrival keeps the send's place (``key``) among events at the same time: with an ideal front end, a
            request sent at the end of a step joins the step that starts then."""
            nonlocal frontend_free
            if at > clock:
                push(at, "send", request)
                return
            frontend_free = max(at, frontend_free) + self.frontend_s
            push(frontend_free, "arrive", request, key)

        def start_step(replica: _Replica, now: float) -> None:
            nonlocal steps
            outputs = replica.engine.step()
            published = replica.engine.blocks.events
            assert published is not None  # _Replica keeps its engine's events
            events_now = list(published)
            published.clear()
            if not outputs and not replica.engine.has_unfinished():
                replica.busy = False
                self._apply_kv_events(replica, events_now)
                return
            steps += 1
            replica.busy = True
            seconds = cast(SimulatedRunner, replica.engine.runner).last_step_s
            if self.frontend_shares_host:
                seconds += max(frontend_free - now, 0.0)
            push(now + seconds, "step", (replica, outputs, events_now))

        for request in requests:
            push(request.at_s, "send", request)
        while events:
            clock, key, kind, payload = heapq.heappop(events)
            if kind == "send":
                send(clock, payload, key)
                continue
            if kind == "arrive":
                request = payload
                record, flight = self._dispatch(request, clock, len(records))
                records.append(record)
                if flight is not None:
                    flights[str(record.index)] = flight
                    if not flight.replica.busy:
                        start_step(flight.replica, clock)
                continue
            replica, outputs, kv_events = payload
            self._apply_kv_events(replica, kv_events)
            for request_id, chunk in outputs:
                flight = flights[request_id]
                flight.record.chunk_times.append(clock)
                flight.output.extend(chunk.token_ids)
                if chunk.finish_reason is not None:
                    self._finish(flight, chunk, clock, send)
                    del flights[request_id]
            start_step(replica, clock)
        return FleetResult(summarize(records, clock - min((r.target_send for r in records), default=0.0)),
                           records, self._per_replica(), steps, clock)

    def _dispatch(self, request: SimRequest, now: float, index: int) -> tuple[RequestRecord, _Flight | None]:
        """The request's record and its flight on the replica the policy chose; no flight for a request every
        replica refuses (as a served one answers 400: the record says why)."""
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True, temperature=0.0,
                                detokenize=False)  # the client's view is its tokens' times: no text to make
        record = RequestRecord(index=index, target_send=request.at_s, actual_send=request.at_s,
                               max_tokens=request.max_tokens, planned_prompt_tokens=len(request.prompt),
                               prompt_tokens=len(request.prompt), fixed_output=True)
        try:  # the replicas are alike: one's admission check is every one's
            self.replicas[0].engine.check_request(request.prompt, params)
        except InvalidRequestError as exc:
            record.end, record.error_kind, record.error = now, "http_400", exc.message
            return record, None
        generation = GenerationRequest(request_id=str(index), model="simulated", params=params, prompt=request.prompt,
                                       user=request.session)
        routed = RoutedRequest(generation, tokens=request.prompt, tokens_source="request", session=request.session)
        candidates = [r.deployment for r in self.replicas]
        choice = self.policy.choose(candidates, routed) if len(candidates) > 1 else None
        deployment = choice.deployment if choice else candidates[0]
        self.policy.dispatched(deployment, routed)
        replica = self._by_deployment[id(deployment)]
        deployment.limiter.in_flight += 1
        replica.engine.add_request(str(index), request.prompt, params)
        return record, _Flight(request, record, replica, routed)

    def _finish(self, flight: _Flight, chunk, now: float, send) -> None:
        record, deployment = flight.record, flight.replica.deployment
        record.end, record.ok = now, True
        record.output_tokens = len(flight.output)
        record.cached_tokens = chunk.usage.cached_tokens if chunk.usage else None
        deployment.limiter.in_flight -= 1
        answered = [*flight.request.prompt, *flight.output]
        self.policy.finished(deployment, flight.routed, answered)
        turn = flight.request.next_turn
        if turn is not None:
            if turn.kept is not None and turn.kept < len(answered):
                answered = answered[:turn.kept] + _tokens(self._rng, len(answered) - turn.kept)
            sent = now + turn.think_s
            send(sent, SimRequest(sent, [*answered, *turn.question], turn.max_tokens, flight.request.session,
                                  turn.next_turn))

    def _apply_kv_events(self, replica: _Replica, kv_events: list) -> None:
        index = getattr(self.policy, "index", None)  # a cache-aware policy's prefix index, kept precise
        if index is None or not self.kv_events:
            return
        name = replica.deployment.name
        for event in kv_events:
            if isinstance(event, BlockStored):
                index.stored(name, event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)
            elif isinstance(event, BlockRemoved):
                index.removed(name, event.block_hashes)
            else:
                index.cleared(name)

    def _per_replica(self) -> dict[str, dict]:
        out = {}
        for r in self.replicas:
            s = r.engine.stats()
            out[r.deployment.name] = {"prompt_tokens": s.prompt_tokens, "generation_tokens": s.generation_tokens,
                                      "prefix_cache_hit_rate": s.prefix_cache_hits / s.prefix_cache_queries
                                      if s.prefix_cache_queries else None, "preemptions": s.preemptions}
        return out


def engine_tokenizer(engine: EngineConfig) -> Tokenizer:
    """The tokenizer an engine of ``engine`` loads (seconds from a GGUF): loaded once, shared by a fleet's engines."""
    from backends.native.weights import default_model_path, open_checkpoint

    if engine.tokenizer:
        return Tokenizer(Path(engine.tokenizer))
    path = Path(engine.model_path) if engine.model_path else default_model_path()
    return Tokenizer(open_checkpoint(path, engine.hf_overrides).tokenizer_path)


# ------------------------------------------------------------------------------------------ workloads
def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*PROMPT_TOKEN_RANGE) for _ in range(n)]


def burst_workload(n: int, input_len: int, output_len: int, arrivals: list[float], seed: int = 0,
                   prefix_len: int = 0, num_prefixes: int = 1) -> list[SimRequest]:
    """``n`` prompts of ``input_len`` tokens (the first ``prefix_len`` those of one of ``num_prefixes`` groups,
    drawn at random),
    ``output_len`` out, sent at ``arrivals`` (``loadtest.schedule.arrival_offsets``)."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len) for _ in range(num_prefixes)]
    return [SimRequest(at, rng.choice(prefixes) + _tokens(rng, input_len - prefix_len), output_len)
            for _, at in zip(range(n), arrivals)]


def conversation_workload(users: int, turns: int, system_len: int, question_len: int, output_len: int,
                          arrivals: list[float], think_s: float = 0.0, seed: int = 0,
                          history_len: int = 0, kept: list[list[int | None]] | None = None) -> list[SimRequest]:
    """``users`` conversations sharing one system prompt, each ``turns`` turns long, started at ``arrivals``, the
    first question after ``history_len`` tokens of the user's own context (the load tester's
    ``--user-history-len``); every turn after the first is sent ``think_s`` after the previous answer, with the
    whole history, of which ``kept[user][k - 1]`` tokens come back as they were in the user's (k + 1)-th turn
    (``SimTurn.kept``; default all)."""
    rng = random.Random(seed)
    system = _tokens(rng, system_len)
    kept = kept or [[None] * (turns - 1)] * users
    requests = []
    for user, at in zip(range(users), arrivals):
        chain: SimTurn | None = None
        for turn in reversed(range(1, turns)):
            chain = SimTurn(_tokens(rng, question_len), output_len, think_s, chain, kept[user][turn - 1])
        first = system + _tokens(rng, history_len + question_len)
        requests.append(SimRequest(at, first, output_len, f"user-{user}", chain))
    return requests


def dataset_workload(path: Path, tokenizer: Tokenizer, n: int | None, output_len: int | None, arrivals: list[float],
                     seed: int = 0) -> list[SimRequest]:
    """The load tester's datasets (``loadtest.workload.from_file``: JSONL, ShareGPT, Alpaca): each prompt as the
    engine's tokenizer counts it (prompts that share text share their cached blocks), its own output length
    unless ``output_len``, sent at ``arrivals``."""
    from loadtest.workload import from_file

    specs = from_file(path, tokenizer, n, output_len, seed)
    return [SimRequest(at, tokenizer.encode(spec.prompt), spec.max_tokens) for spec, at in zip(specs, arrivals)]


def trace_workload(path: Path, block_size: int = 512, time_scale: float = 1.0, seed: int = 0) -> list[SimRequest]:
    """A Mooncake-format trace (``loadtest.trace``): requests with equal ``hash_ids`` share those prompt blocks."""
    from loadtest.trace import read_trace

    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    requests = []
    for r in read_trace(path, block_size):
        if r.hash_ids:
            prompt = [t for h in r.hash_ids for t in blocks.setdefault(h, _tokens(rng, block_size))]
            prompt = prompt[:r.input_length]
        elif r.input_length is not None:
            prompt = _tokens(rng, r.input_length)
        else:  # a trace of prompt texts: the load tester sends those, the simulator has no tokenizer run for them
            raise ValueError(f"{path}: the simulator needs each request's input_length (or its hash_ids)")
        requests.append(SimRequest(r.at_s * time_scale, prompt, r.output_length, r.session))
    return requests
