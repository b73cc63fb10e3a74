"""What to send: synthetic prompts of an exact token length, shared-prefix prompts, or local datasets.

Synthetic prompts follow vLLM's recipe: random token ids → decode → re-encode → trim or extend until
the target tokenizer counts exactly the asked length. The preset ``paper`` is arXiv 2311.03687's
burst: 1000 prompts of 512 tokens with a fixed output length and ignore_eos.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class RequestSpec:
    prompt: str
    prompt_tokens: int  # as counted by the workload's tokenizer (0 if unknown)
    max_tokens: int


def load_tokenizer(name_or_path: str | None) -> TokenizerLike:
    """A local HF tokenizer directory, a .gguf file, or (None) the embedded SmolLM2's. Never downloads."""
    from backends.native.weights import default_model_path
    from backends.tokenizer import Tokenizer

    return Tokenizer(Path(name_or_path) if name_or_path else default_model_path())


def exact_length_prompt(tokenizer: TokenizerLike, length: int, rng: random.Random, vocab: list[int],
                        start: str = "") -> str:
    """Text that ``tokenizer`` encodes (without special tokens) to exactly ``length`` tokens: ``start``
    trimmed or extended with random tokens, or random tokens altogether."""
    text = start or tokenizer.decode([rng.choice(vocab) for _ in range(length)])
    for _ in range(20):
        got = tokenizer.encode(text, add_special_tokens=False)
        if len(got) == length:
            return text
        if len(got) > length:
            text = tokenizer.decode(got[:length])
        else:
            text = tokenizer.decode(got + [rng.choice(vocab) for _ in range(length - len(got))])
    raise ValueError(f"could not build a prompt of exactly {length} tokens")


def _plain_vocab(tokenizer) -> list[int]:
    """Token ids that decode to ordinary text (no special or byte-fallback tokens)."""
    hf = getattr(tokenizer, "hf", None)
    size = len(hf) if hf is not None else 32000
    special = set(getattr(hf, "all_special_ids", []) or [])
    return [i for i in range(size) if i not in special]


def synthetic(tokenizer: TokenizerLike, n: int, input_len: int | tuple[int, int], output_len: int | tuple[int, int],
              seed: int = 0, prefix_len: int = 0, num_prefixes: int = 1) -> list[RequestSpec]:
    """``n`` prompts of ``prefix_len`` shared tokens (one of ``num_prefixes`` prefixes) + a random rest.

    Lengths are fixed ints or inclusive (low, high) ranges drawn uniformly; everything is seeded.
    """
    rng = random.Random(seed)
    vocab = _plain_vocab(tokenizer)
    prefixes = [exact_length_prompt(tokenizer, prefix_len, rng, vocab) if prefix_len else ""
                for _ in range(num_prefixes)]
    specs = []
    for i in range(n):
        total = _draw(input_len, rng)
        if total <= prefix_len:
            raise ValueError(f"input length {total} must exceed the shared prefix length {prefix_len}")
        prefix = prefixes[i % num_prefixes]
        text = prefix + exact_length_prompt(tokenizer, total - prefix_len, rng, vocab)
        # Joining can merge tokens at the seam; fix the total by re-trimming the whole prompt.
        if len(tokenizer.encode(text, add_special_tokens=False)) != total:
            text = exact_length_prompt(tokenizer, total, rng, vocab, start=text)
        specs.append(RequestSpec(text, total, _draw(output_len, rng)))
    return specs


def _draw(value: int | tuple[int, int], rng: random.Random) -> int:
    return value if isinstance(value, int) else rng.randint(value[0], value[1])


def paper_preset(tokenizer: TokenizerLike, output_len: int = 128, n: int = 1000, seed: int = 0) -> list[RequestSpec]:
    """arXiv 2311.03687's burst: 1000 prompts × 512 tokens, fixed max output, sent at t=0."""
    return synthetic(tokenizer, n, 512, output_len, seed)


# ------------------------------------------------------------------------------------------ datasets
def from_file(path: Path, tokenizer: TokenizerLike | None, n: int | None, output_len: int | None,
              seed: int = 0) -> list[RequestSpec]:
    """Prompts from JSONL (``{"prompt": ..., "max_tokens"?: ...}`` per line), ShareGPT JSON
    (``conversations`` with ``from``/``value``: first human turn, reply length from the gpt turn) or
    Alpaca JSON (``instruction``/``input``/``output``). Shuffled with ``seed``, first ``n`` kept."""
    try:
        pairs = _read_pairs(path, tokenizer)
    except (ValueError, KeyError, TypeError, AttributeError, StopIteration) as exc:
        raise ValueError(f"{path}: not a usable JSONL / ShareGPT / Alpaca file ({type(exc).__name__}: {exc})") from exc
    random.Random(seed).shuffle(pairs)
    pairs = pairs[:n] if n else pairs
    if not pairs:
        raise ValueError(f"{path}: no usable prompts")
    return [RequestSpec(p, _count(tokenizer, p) or 0, output_len or max(1, int(m or 128))) for p, m in pairs]


def _read_pairs(path: Path, tokenizer) -> list[tuple[str, int | None]]:
    text = path.read_text()
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        pairs = [(str(r["prompt"]), r.get("max_tokens")) for r in rows]
    else:
        data = json.loads(text)
        if not isinstance(data, list) or not data:
            raise ValueError("expected a non-empty JSON list")
        if "conversations" in data[0]:
            pairs = [_sharegpt_pair(r, tokenizer) for r in data if len(r.get("conversations", [])) >= 2]
        elif "instruction" in data[0]:
            pairs = [(_alpaca_prompt(r), _count(tokenizer, r.get("output", ""))) for r in data]
        else:
            raise ValueError("neither ShareGPT (conversations) nor Alpaca (instruction) records")
    return pairs


def _sharegpt_pair(record: dict, tokenizer) -> tuple[str, int | None]:
    turns = record["conversations"]
    human = next(t["value"] for t in turns if t.get("from") in ("human", "user"))
    reply = next((t["value"] for t in turns if t.get("from") in ("gpt", "assistant")), "")
    return human, _count(tokenizer, reply)


def _alpaca_prompt(r: dict) -> str:
    return r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")


def _count(tokenizer, text: str) -> int | None:
    return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else None
