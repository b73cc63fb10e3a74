"""Continuous batching at iteration level. Policy only: no tensors, no model.

Each step: running sequences first (decodes, and prefills already under way), in arrival order, then
waiting sequences FCFS while the token budget (``max_num_batched_tokens``) and ``max_num_seqs`` allow,
their prompts chunked to fit. When blocks run out the newest running sequence is preempted: its blocks
are freed and it is recomputed later from its tokens (vLLM's RECOMPUTE policy).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from backends.base import FinishReason
from backends.native.batch import Batch
from backends.native.block_manager import BlockManager
from backends.native.config import EngineConfig
from backends.native.sampler import Sampled
from backends.native.sequence import Sequence, Status


@dataclass
class ScheduledStep:
    """What the scheduler chose: the sequences, tokens computed for each, and the flat batch."""

    seqs: list[Sequence]
    num_tokens: list[int]
    batch: Batch

    @property
    def sampling(self) -> list[Sequence]:
        """The sequences that get a new token from this step, in batch order."""
        return [seq for seq, sample in zip(self.seqs, self.batch.sample) if sample]


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
        """Drop ``seq`` wherever it is and free its blocks. Safe to call twice."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is not Status.FINISHED:
            self.blocks.free(seq)
            seq.status = Status.FINISHED
            seq.finish_reason = reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -------------------------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledStep | None:
        budget = self.config.max_num_batched_tokens
        chosen: dict[Sequence, int] = {}
        preempted = False

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed, budget)
            while not self.blocks.allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                budget += chosen.pop(victim, 0)
                preempted = True
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                chosen[seq] = n
                budget -= n

        # Admitting new work right after a preemption would only thrash the cache.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
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
            seq.status = Status.RUNNING
            self.running.append(seq)
            chosen[seq] = n
            budget -= n

        if not chosen:
            return None
        # Single-token sequences first, longest context first: the attention paths batch them together.
        order = sorted(chosen, key=lambda s: (chosen[s] != 1, -s.num_computed))
        return ScheduledStep(order, [chosen[s] for s in order], self._batch(order, chosen))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _batch(self, seqs: list[Sequence], chosen: dict[Sequence, int]) -> Batch:
        bs = self.blocks.block_size
        token_ids, positions, slots, qlens, ctxs, tables, sample = [], [], [], [], [], [], []
        for seq in seqs:
            n, start = chosen[seq], seq.num_computed
            table = seq.block_table
            if n == 1:  # a decode: most of a large batch
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
        return Batch(token_ids, positions, slots, qlens, ctxs, tables, sample)

    def postprocess(self, step: ScheduledStep, sampled: list[Sampled]) -> list[Update]:
        """Everything a finished step changes, in one place: computed tokens advance (and full blocks enter
        the prefix cache), each sampling sequence gets its token (``sampled``, in ``step.sampling`` order),
        the stop rules decide whether it ends, and ended sequences give their blocks back."""
        updates, picks = [], iter(sampled)
        for seq, n, samples in zip(step.seqs, step.num_tokens, step.batch.sample):
            seq.num_computed += n
            self.blocks.register_full_blocks(seq)
            if not samples:
                continue
            pick = next(picks)
            seq.token_ids.append(pick.token_id)
            text, reason = seq.stop.add(pick.token_id, seq.num_tokens)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            updates.append(Update(seq, pick, text, reason))
        return updates
