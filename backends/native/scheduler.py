"""Continuous batching at iteration level. Policy only: no tensors, no model.

Each step: running sequences first (decodes, and prefills already under way), in arrival order, then
waiting sequences FCFS while the token budget (``max_num_batched_tokens``) and ``max_num_seqs`` allow,
their prompts chunked to fit. When blocks run out the newest running sequence is preempted: its blocks
are freed and it is recomputed later from its tokens (vLLM's RECOMPUTE policy).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from backends.native.batch import Batch
from backends.native.kv_cache import BlockManager
from backends.native.sequence import Sequence, Status


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True


@dataclass
class ScheduledStep:
    """What the scheduler chose: the sequences, tokens computed for each, and the flat batch."""

    seqs: list[Sequence]
    num_tokens: list[int]
    batch: Batch


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
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

    def finish(self, seq: Sequence, reason: str) -> None:
        """Called after a step for a sequence that met a stop condition."""
        self.running.remove(seq)
        self._finish(seq, reason)

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
            token_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            qlens.append(n)
            ctxs.append(start + n)
            tables.append(table)
            sample.append(start + n == seq.num_tokens)
        return Batch(token_ids, positions, slots, qlens, ctxs, tables, sample)

    def complete(self, step: ScheduledStep) -> None:
        """Record that the step's tokens are now in the cache (before sampled tokens are appended)."""
        for seq, n in zip(step.seqs, step.num_tokens):
            if seq.status is Status.RUNNING:
                seq.num_computed += n
                self.blocks.register_full_blocks(seq)
