"""What to send: synthetic prompts of an exact token length, shared-prefix prompts, or local datasets.

Synthetic prompts follow vLLM's recipe: random token ids → decode → re-encode → trim or extend until
the tokenizer counts exactly the asked length. Then ``fit`` lands each prompt on that length as the
target counts it: through the server's ``/tokenize`` when it has one (vLLM's bench re-aligns through it
too), else with the target's local tokenizer; special tokens the server adds and, for chat, the chat
template's own tokens count towards the length. The preset ``paper`` is arXiv 2311.03687's burst:
1000 prompts of 512 tokens with a fixed output length and ignore_eos.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import aiohttp


class TokenizerLike(Protocol):
    def __hash__(self) -> int: ...  # workloads cache per tokenizer
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class RequestSpec:
    prompt: str
    prompt_tokens: int  # as counted by the workload's tokenizer (0 if unknown)
    max_tokens: int
    # a turn of a multi-turn conversation (``conversations``): sent after the conversation's previous turn was
    # answered, with the system prompt and the whole history before ``prompt`` (the runner builds the messages)
    conversation: int | None = None
    system: str | None = None
    messages: list[dict] | None = None  # the chat messages to send, where built
    at_s: float | None = None  # a replayed trace's send time (seconds from the start)
    session: int | None = None  # a replayed trace's session: sent after its previous request was answered


def load_tokenizer(name_or_path: str | Path | None) -> TokenizerLike:
    """A local HF tokenizer directory, a .gguf file, or (None) the embedded SmolLM2's. Never downloads."""
    from backends.tokenizer import Tokenizer

    return Tokenizer(Path(name_or_path) if name_or_path else embedded_tokenizer_dir())


def embedded_tokenizer_dir() -> Path:
    """The embedded SmolLM2's tokenizer saved as an HF directory in the user's cache: rebuilding it from
    the GGUF takes about 10 s here, loading the saved one 0.3 s."""
    import hashlib
    import os
    import shutil
    import tempfile

    from backends.native.weights import default_model_path
    from backends.tokenizer import Tokenizer

    gguf = default_model_path()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "burstgate" / f"tokenizer-{key}"
    if not (cache / "tokenizer.json").exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache.parent))
        Tokenizer(gguf).hf.save_pretrained(tmp)
        try:
            tmp.rename(cache)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    return cache


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
    if prefix_len and num_prefixes > 1:
        rng.shuffle(specs)  # groups of equal size, in random order (SGLang's generated-shared-prefix), not cycling
    return specs


def _draw(value: int | tuple[int, int], rng: random.Random) -> int:
    return value if isinstance(value, int) else rng.randint(value[0], value[1])


def paper_preset(tokenizer: TokenizerLike, output_len: int | tuple[int, int] = 128, n: int = 1000, seed: int = 0) -> list[RequestSpec]:
    """arXiv 2311.03687's burst: 1000 prompts × 512 tokens, fixed max output, sent at t=0."""
    return synthetic(tokenizer, n, 512, output_len, seed)


def conversations(tokenizer: TokenizerLike, users: int, turns: int, system_len: int, question_len: int,
                  output_len: int, seed: int = 0, history_len: int = 0) -> list[RequestSpec]:
    """Multi-turn chat sessions (the shape of vLLM production-stack's multi-round QA): ``users`` conversations of
    ``turns`` questions of ``question_len`` tokens each, all after one shared system prompt of ``system_len``
    tokens, the first question after ``history_len`` tokens of the user's own context (production-stack's
    ``--user-history-prompt``: earlier history, a document); every turn carries the whole conversation so far,
    the model's answers included, so a server that keeps the history's KV cache prefills only the new question."""
    rng = random.Random(seed)
    vocab = _plain_vocab(tokenizer)
    system = exact_length_prompt(tokenizer, system_len, rng, vocab) if system_len else ""
    specs = []
    for user in range(users):
        for turn in range(turns):
            length = question_len + (history_len if turn == 0 else 0)
            specs.append(RequestSpec(exact_length_prompt(tokenizer, length, rng, vocab), length, output_len,
                                     conversation=user, system=system))
    return specs


# ------------------------------------------------------------------------ lengths as the target counts
class PromptCounter(Protocol):
    """Counts prompts as one target does: ``count`` includes the special tokens and chat template the
    server adds; ``encode``/``decode`` work on the prompt text's own tokens."""

    name: str

    async def count(self, text: str) -> int: ...
    async def encode(self, text: str) -> list[int]: ...
    async def decode(self, ids: list[int]) -> str: ...


class LocalCounter:
    """A local tokenizer standing in for the target's (when the server has no /tokenize)."""

    def __init__(self, tokenizer, chat: bool, name: str) -> None:
        self.tokenizer, self.chat, self.name = tokenizer, chat, name

    async def count(self, text: str) -> int:
        if self.chat:
            return len(self.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        return len(self.tokenizer.encode(text, add_special_tokens=True))

    async def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


class ServerCounter:
    """The target's own ``/tokenize`` and ``/detokenize`` (vLLM's shapes; burstgate serves them too)."""

    name = "server /tokenize"

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, chat: bool,
                 headers: dict[str, str] | None = None) -> None:
        self.session, self.url, self.model, self.chat, self.headers = session, url, model, chat, headers or {}

    async def count(self, text: str) -> int:
        body: dict[str, Any]
        if self.chat:
            body = {"model": self.model, "messages": [{"role": "user", "content": text}]}
        else:
            body = {"model": self.model, "prompt": text, "add_special_tokens": True}
        return (await self._post("/tokenize", body))["count"]

    async def encode(self, text: str) -> list[int]:
        return (await self._post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False}))[
            "tokens"]

    async def decode(self, ids: list[int]) -> str:
        return (await self._post("/detokenize", {"model": self.model, "tokens": ids}))["prompt"]

    async def _post(self, path: str, body: dict) -> dict:
        try:
            return await self._post_once(path, body)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            # The pooled connection was closed by the server unseen (its keep-alive ran out while this loop was
            # busy building prompts), found as the request went out or as its answer was awaited: once more, on a
            # fresh one; /tokenize and /detokenize change nothing.
            return await self._post_once(path, body)

    async def _post_once(self, path: str, body: dict) -> dict:
        async with self.session.post(self.url + path, json=body, headers=self.headers) as r:
            r.raise_for_status()
            return await r.json()

    async def works(self) -> bool:
        """Whether the server answers /tokenize in the way this endpoint needs."""
        try:
            return await self.count("Hello") > 0 and bool(await self.encode("Hello"))
        except (TimeoutError, aiohttp.ClientError, KeyError, ValueError, TypeError):
            return False


async def fit_prompt(text: str, length: int, counter: PromptCounter) -> str:
    """``text`` trimmed or extended (with its own tokens) until ``counter`` counts exactly ``length``."""
    for attempt in range(20):
        total = await counter.count(text)
        if total == length:
            return text
        ids = await counter.encode(text)
        want = len(ids) + length - total
        if want < 1:
            raise ValueError(f"a prompt of {length} tokens cannot be built: the target adds {total - len(ids)} "
                             "tokens of its own (special tokens or chat template)")
        if want <= len(ids):
            ids = ids[:want]
        else:  # reuse the prompt's own ids, shifted each attempt so a seam that merges tokens moves
            ids = ids + list(itertools.islice(itertools.cycle(ids[attempt % len(ids):] + ids), want - len(ids)))
        text = await counter.decode(ids)
    raise ValueError(f"could not build a prompt of exactly {length} tokens for {counter.name}")


async def fit(specs: list[RequestSpec], counter: PromptCounter, exact: bool = True,
              parallel: int = 16) -> list[RequestSpec]:
    """``specs`` with prompt lengths as the target counts them: each prompt fitted to its planned length
    (``exact``), or only re-counted (dataset prompts, which must not be cut)."""
    gate = asyncio.Semaphore(parallel)

    async def one(spec: RequestSpec) -> RequestSpec:
        async with gate:
            if exact:
                return replace(spec, prompt=await fit_prompt(spec.prompt, spec.prompt_tokens, counter))
            return replace(spec, prompt_tokens=await counter.count(spec.prompt))

    return list(await asyncio.gather(*(one(s) for s in specs)))


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
