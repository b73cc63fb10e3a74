"""The deterministic "model" behind the wire-format fakes: it always answers the same script.

Prompt tokens are whitespace-separated words. Output tokens are the words of ``SCRIPT`` (ids from
1000), then the end-of-sequence token; ``max_new_tokens`` and stop strings end it earlier. Prompts
containing ``CRASH`` fail after two tokens and ``CUT`` drops the connection after two tokens, so
tests can reach the servers' mid-stream failure paths.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

SCRIPT = "The quick brown fox jumps over the lazy dog ."
EOS_ID, EOS_TEXT = 2, "</s>"


@dataclass
class Token:
    id: int
    text: str
    special: bool = False
    logprob: float = -0.5


@dataclass
class Step:
    token: Token
    finish_reason: str | None  # "length" | "eos_token" | "stop_sequence" | None
    generated_text: str  # everything so far, stop sequence included (as TGI and LightLLM return it)


def prompt_tokens(prompt: str) -> int:
    return len(prompt.split())


def generate(prompt: str, max_new_tokens: int, stop: list[str] = ()) -> Iterator[Step]:
    words = [" " + w for w in SCRIPT.split()]
    text = ""
    for i in range(max_new_tokens):
        if i == 2 and "CRASH" in prompt:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if i == 2 and "CUT" in prompt:
            raise ConnectionAbortedError
        if i < len(words):
            token = Token(1000 + i, words[i])
            text += token.text
        else:
            token = Token(EOS_ID, EOS_TEXT, special=True)
        if token.special:
            reason = "eos_token"
        elif any(s in text for s in stop):
            reason = "stop_sequence"
        elif i == max_new_tokens - 1:
            reason = "length"
        else:
            reason = None
        yield Step(token, reason, text)
        if reason:
            return
