"""One sequence's state inside the engine: its tokens, how many are in the KV cache, its blocks.

A request with ``n`` > 1 is ``n`` sequences: the first (index 0) prefills the prompt; the others wait in
its ``forks`` and, once the prompt is computed, take a copy of its block table (the blocks shared,
reference-counted) and their own first token from the same logits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from backends.base import FinishReason, SamplingParams
from backends.stopping import StopChecker


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)  # prompt followed by generated tokens
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    num_cached_prompt: int = 0  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache
    finish_reason: FinishReason | None = None
    admitted: bool = False  # has been scheduled at least once
    generator: Any = None  # torch.Generator for seeded sampling, owned by the engine
    stop: StopChecker | None = None  # detokenizes and decides when it ends (set by the engine)
    index: int = 0  # the choice it answers (of a request with n > 1)
    grammar: Any = None  # xgrammar GrammarMatcher of a structured output, advanced token by token
    forks: list[Sequence] = field(default_factory=list)  # siblings waiting for this one's prompt
    prompt_logprobs: list | None = None  # per prompt token, collected while prefilling (None: not asked)
    # async scheduling: the last token is a placeholder for the in-flight step's pick of this index (scheduler.py)
    pending: int | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed
