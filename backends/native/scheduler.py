"""Continuous batching at iteration level. Policy only: no tensors, no model.

Each step: running sequences first (decodes, and prefills already under way), in arrival order, then
waiting sequences FCFS while the token budget (``max_num_batched_tokens``) and ``max_num_seqs`` allow,
their prompts chunked to fit. When blocks run out the newest running sequence is preempted: its blocks
are freed and it is recomputed later from its tokens (vLLM's RECOMPUTE policy). The other samples of a
request with ``n`` > 1 join the batch when its prompt is computed (``Sequence.forks``): they share its
blocks and sample their first token from the same logits.

After a step, ``advance`` records what it computed and ``resolve`` what it sampled (``postprocess``: both).
With async scheduling (vLLM's) the engine calls ``advance`` as soon as a step is launched and ``resolve``
one step later: each sampling sequence then ends with a placeholder token (``Sequence.pending``), the next
step is scheduled over it and reads the real token from the device (``Batch.placeholders``), and the stop
rules run while the GPU computes. A sequence that stopped in step N was scheduled in step N+1 too: that
token is dropped. One whose placeholder is its last token by length is not scheduled again.

Under pipeline parallelism several batches are in flight at once (the engine's ``_pipelined_step``): a batch
takes only sequences that none in flight holds (``busy``), and those are never preempted to make room; the engine
caps each batch's sequences (``max_seqs``) so that the live ones spread over the batches in flight.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from backends.base import FinishReason
from backends.native.batch import Batch
from backends.native.block_manager import BlockManager
from backends.native.config import EngineConfig
from backends.native.sampler import Sampled
from backends.native.sequence import Sequence, Status
from backends.stopping import StopChecker

PLACEHOLDER = -1  # a token still on the device (async scheduling): never hashed, replaced before the model reads it


@dataclass
class ScheduledStep:
    """What the scheduler chose: the sequences, tokens computed for each, and the flat batch."""

    seqs: list[Sequence]
    num_tokens: list[int]
    batch: Batch
    # The sequences that get a new token from this step, in batch order; the waiting forks of a prompt
    # computed by this step follow it (they sample from its logits row). Fixed when scheduled.
    sampling: list[Sequence] = field(init=False)

    def __post_init__(self) -> None:
        self.sampling = []
        for seq, sample in zip(self.seqs, self.batch.sample):
            if sample:
                self.sampling.append(seq)
                self.sampling.extend(seq.forks)


@dataclass
class Update:
    """What a step did to one sampling sequence: its new token, the text it completes, and whether it ended."""

    seq: Sequence
    sampled: Sampled
    text: str
    finish_reason: FinishReason | None


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        """Reads ``max_num_seqs``, ``max_num_batched_tokens`` and ``enable_chunked_prefill`` of ``config``."""
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------------------ membership
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` (and forks still waiting for its prompt) wherever it is, freeing its blocks. Safe to
        call twice."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        for fork in seq.forks:
            self._finish(fork, "abort")
        seq.forks = []
        self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is not Status.FINISHED:
            self.blocks.free(seq)
            seq.status = Status.FINISHED
            seq.finish_reason = reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -------------------------------------------------------------------------------- schedule
    def schedule(self, busy: frozenset[Sequence] | set[Sequence] = frozenset(),
                 max_seqs: int | None = None) -> ScheduledStep | None:
        """The next batch, of at most ``max_seqs`` sequences not in ``busy`` (held by batches in flight), or None
        if nothing can run."""
        budget = self.config.max_num_batched_tokens
        room = max_seqs or self.config.max_num_seqs
        chosen: dict[Sequence, int] = {}
        preempted = False
        admitted = 0

        for seq in list(self.running):
            if budget == 0 or len(chosen) == room:
                break
            if seq.status is not Status.RUNNING or seq in busy:
                continue  # preempted earlier in this loop, or its last step is still in flight
            if seq.pending is not None and _stop(seq).ends_by_length(seq.num_output, seq.num_tokens):
                continue  # its in-flight token is its last: nothing more to compute
            n = min(seq.num_uncomputed, budget)
            while not (allocated := self.blocks.allocate(seq, n)):
                victim = next((s for s in reversed(self.running) if s not in busy), None)
                if victim is None:
                    break  # every other sequence is in flight: this one waits for them
                self._preempt(victim)
                budget += chosen.pop(victim, 0)
                preempted = True
                if victim is seq:
                    break
            if allocated:
                chosen[seq] = n
                budget -= n

        # Admitting new work right after a preemption would only thrash the cache.
        while (self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs
               and len(chosen) < room):
            seq = self.waiting[0]
            hits = self.blocks.match_prefix(seq)
            remaining = seq.num_uncomputed - len(hits) * self.blocks.block_size
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            n = min(remaining, budget)
            if not self.blocks.allocate(seq, n, hits):
                break
            self.waiting.popleft()
            if not seq.admitted:
                seq.admitted = True
                seq.num_cached_prompt = seq.num_computed
                admitted += 1
            seq.status = Status.RUNNING
            self.running.append(seq)
            chosen[seq] = n
            budget -= n

        if not chosen:
            return None
        # Single-token sequences first, longest context first: the attention paths batch them together.
        order = sorted(chosen, key=lambda s: (chosen[s] != 1, -s.num_computed))
        batch = self._batch(order, chosen)
        batch.block_copies = self.blocks.take_copies()
        batch.admitted = admitted
        return ScheduledStep(order, [chosen[s] for s in order], batch)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _batch(self, seqs: list[Sequence], chosen: dict[Sequence, int]) -> Batch:
        bs = self.blocks.block_size
        token_ids: list[int] = []
        positions, slots, qlens, ctxs, tables, sample, all_logits = [], [], [], [], [], [], []
        placeholders: list[tuple[int, int]] = []
        for seq in seqs:
            n, start = chosen[seq], seq.num_computed
            table = seq.block_table
            if n == 1:  # a decode: most of a large batch
                if seq.pending is not None:  # its token is the in-flight step's pick, still on the device
                    placeholders.append((len(token_ids), seq.pending))
                token_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                token_ids.extend(seq.token_ids[start:start + n])
                positions.extend(range(start, start + n))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            qlens.append(n)
            ctxs.append(start + n)
            tables.append(table)
            sample.append(start + n == seq.num_tokens)
            # Prompt logprobs: every position of a chunk that predicts prompt tokens not collected yet.
            all_logits.append(seq.prompt_logprobs is not None and start + n > len(seq.prompt_logprobs) - 1
                              and len(seq.prompt_logprobs) < seq.num_prompt)
        return Batch(token_ids, positions, slots, qlens, ctxs, tables, sample, all_logits, placeholders=placeholders)

    def postprocess(self, step: ScheduledStep, sampled: list[Sampled]) -> list[Update]:
        """Everything a finished step changes, in one place: ``advance`` then ``resolve``."""
        self.advance(step)
        return self.resolve(step, sampled)

    def advance(self, step: ScheduledStep, pending: bool = False) -> None:
        """What a step computed: computed tokens advance (and full blocks enter the prefix cache), a computed
        prompt's forks join with its blocks shared; with ``pending`` (async scheduling) each sampling sequence
        gets a placeholder for its token, the index of its pick. Sequences that ended meanwhile are left out."""
        for seq, n, samples in zip(step.seqs, step.num_tokens, step.batch.sample):
            if seq.status is Status.FINISHED:
                continue  # stopped by the step before (async scheduling) or aborted
            seq.num_computed += n
            self.blocks.register_full_blocks(seq)  # before a placeholder: every hashed token is real
            if samples:
                for fork in seq.forks:
                    self._fork(seq, fork)
                seq.forks = []
        if pending:
            for i, seq in enumerate(step.sampling):
                if seq.status is not Status.FINISHED:
                    seq.token_ids.append(PLACEHOLDER)
                    seq.pending = i

    def resolve(self, step: ScheduledStep, sampled: list[Sampled]) -> list[Update]:
        """What a step sampled (``sampled``, in ``step.sampling`` order): each sequence gets its token (in
        place of its placeholder) and its grammar advances, the stop rules decide whether it ends, and ended
        sequences give their blocks back. Sequences that ended meanwhile drop theirs."""
        return [self._append(seq, pick) for seq, pick in zip(step.sampling, sampled)
                if seq.status is not Status.FINISHED]

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        self.blocks.fork(parent, child)
        child.num_computed = parent.num_computed
        child.num_cached_prompt = parent.num_cached_prompt
        child.admitted = True
        child.status = Status.RUNNING
        self.running.append(child)

    def _append(self, seq: Sequence, pick: Sampled) -> Update:
        if seq.pending is not None:
            seq.token_ids[-1], seq.pending = pick.token_id, None
        else:
            seq.token_ids.append(pick.token_id)
        text, reason = _stop(seq).add(pick.token_id, seq.num_tokens)
        if seq.grammar is not None and not seq.grammar.is_terminated() and not seq.grammar.accept_token(pick.token_id):
            reason = reason or "abort"  # the grammar allowed no token (e.g. all masked): nothing valid can follow
        if reason is not None:
            if seq.status is Status.RUNNING:
                self.running.remove(seq)
            elif seq in self.waiting:  # preempted while its token was in flight
                self.waiting.remove(seq)
            self._finish(seq, reason)
        return Update(seq, pick, text, reason)


def _stop(seq: Sequence) -> StopChecker:
    """The sequence's stop checker, which the engine sets when it admits the request."""
    assert seq.stop is not None, f"{seq.request_id} was scheduled without a stop checker"
    return seq.stop
