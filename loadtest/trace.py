"""Trace replay: requests at the times a production trace recorded, with its prefix sharing made real.

Two JSONL shapes, one request per line, read by one parser:

- Mooncake's (``{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}``,
  as Dynamo's and Mooncake's replay tools read it): ``timestamp`` in milliseconds, one hash id per block of
  ``block_size`` prompt tokens (512 in Mooncake's traces; the last block may be partial). Equal hash ids are
  equal blocks: every request that lists hash id 46 carries the same 512 tokens there.
- A plain one: ``timestamp`` (ms), then ``prompt`` (text sent as is) or ``input_length`` (tokens, built as
  for synthetic prompts), ``output_length``, and an optional ``session_id``: a session's requests go one
  after another, each at its own time or once the previous one was answered, whichever is later.

Blocks are built from whole-word tokens (`` the``, `` cat``) that a BPE tokenizer keeps apart when joined, so
a prompt is exactly as long as its hash ids say and two requests share exactly their common blocks; the
session then trims each prompt's end to the length the target counts (its special tokens and chat template
included). Blocks are salted per target and point, as every other workload's prompts.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

from loadtest.workload import RequestSpec, TokenizerLike

MOONCAKE_BLOCK_SIZE = 512


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace, times in seconds from the trace's first request."""

    at_s: float
    output_length: int
    input_length: int | None = None
    prompt: str | None = None
    hash_ids: tuple[int, ...] = ()
    session: str | None = None


def read_trace(path: Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> list[TraceRequest]:
    """The trace's requests in time order; raises ValueError naming the first bad line."""
    requests = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    requests.append(_request(json.loads(line), block_size))
                except (ValueError, TypeError, KeyError) as exc:
                    raise ValueError(f"{path} line {number}: {exc}") from None
    if not requests:
        raise ValueError(f"{path}: no requests")
    if len({r.prompt is None for r in requests}) > 1:
        raise ValueError(f"{path}: give every request a prompt or every request an input_length, not a mix")
    start = min(r.at_s for r in requests)
    return sorted((_shift(r, start) for r in requests), key=lambda r: r.at_s)


def _request(row: dict, block_size: int) -> TraceRequest:
    if not isinstance(row, dict):
        raise ValueError("each line must be a JSON object")
    unknown = set(row) - {"timestamp", "input_length", "output_length", "hash_ids", "prompt", "session_id"}
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
    at_ms, output = float(row["timestamp"]), int(row["output_length"])
    if not at_ms >= 0 or output < 1:
        raise ValueError("timestamp must be >= 0 (ms) and output_length >= 1")
    session = None if row.get("session_id") is None else str(row["session_id"])
    if "prompt" in row:
        if "input_length" in row or "hash_ids" in row:
            raise ValueError("a prompt is sent as given: drop input_length and hash_ids")
        return TraceRequest(at_ms / 1000, output, prompt=str(row["prompt"]), session=session)
    length = int(row["input_length"])
    hash_ids = tuple(int(h) for h in row.get("hash_ids", ()))
    if length < 1:
        raise ValueError("input_length must be >= 1")
    if hash_ids and len(hash_ids) != -(-length // block_size):
        raise ValueError(f"{len(hash_ids)} hash_ids for {length} tokens: expected one per {block_size}-token "
                         "block (set the block size with --trace-block-size)")
    return TraceRequest(at_ms / 1000, output, input_length=length, hash_ids=hash_ids, session=session)


def _shift(r: TraceRequest, start: float) -> TraceRequest:
    return TraceRequest(r.at_s - start, r.output_length, r.input_length, r.prompt, r.hash_ids, r.session)


def trace_specs(trace: list[TraceRequest], tokenizer: TokenizerLike, block_size: int, seed: int,
                time_scale: float = 1.0) -> list[RequestSpec]:
    """The requests to send: prompts built from salted blocks (or given), due at ``at_s * time_scale``."""
    words = _word_tokens(tokenizer)
    sessions: dict[str, int] = {}
    specs = []
    for i, r in enumerate(trace):
        session = sessions.setdefault(r.session, len(sessions)) if r.session is not None else None
        if r.prompt is not None:
            prompt, length = r.prompt, len(tokenizer.encode(r.prompt, add_special_tokens=False))
        else:
            ids = _prompt_ids(r, block_size, words, seed, i)
            prompt, length = tokenizer.decode(ids), len(ids)
        specs.append(RequestSpec(prompt, length, r.output_length, at_s=r.at_s * time_scale, session=session))
    return specs


def _prompt_ids(r: TraceRequest, block_size: int, words: list[int], seed: int, index: int) -> list[int]:
    """The hash ids' blocks, cut to the input length; a request without hash ids has blocks of its own."""
    length = r.input_length
    assert length is not None  # read_trace: a line without a prompt has its length
    hash_ids: tuple[Hashable, ...] = r.hash_ids or tuple(("unshared", index, b) for b in range(-(-length // block_size)))
    ids = [t for h in hash_ids for t in _block(h, block_size, words, seed)]
    return ids[:length]


def _block(hash_id, block_size: int, words: list[int], seed: int) -> list[int]:
    rng = random.Random(f"{seed}:{hash_id}")  # the same hash id gives the same block within one point
    return [rng.choice(words) for _ in range(block_size)]


_WORD = re.compile(r" [a-z]{3,}")


@functools.cache
def _word_tokens(tokenizer: TokenizerLike) -> list[int]:
    """Tokens that decode to a space and a lower-case word and encode back to themselves alone: joined in any
    order, they stay one token each (pre-tokenisation splits at the spaces), so lengths add up exactly."""
    size = len(tokenizer.hf) if hasattr(tokenizer, "hf") else 32000
    words = []
    for token in range(size):
        text = tokenizer.decode([token])
        if _WORD.fullmatch(text) and tokenizer.encode(text, add_special_tokens=False) == [token]:
            words.append(token)
    if len(words) < 100:
        raise ValueError("the tokenizer has too few whole-word tokens to build trace prompts")
    return words


def describe(path: Path, trace: list[TraceRequest], block_size: int, time_scale: float) -> str:
    """The trace's part of the workload key: runs of one trace at one time scale compare like with like."""
    desc = f"trace={path.name} n={len(trace)} span={trace[-1].at_s:.1f}s"
    if any(r.hash_ids for r in trace):
        desc += f" block={block_size}"
    return desc + (f" time_scale={time_scale:g}" if time_scale != 1.0 else "")
