"""Tokenizer, chat template and incremental detokenisation for the native engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backends.base import InvalidRequestError


class Tokenizer:
    """Wraps the HF fast tokenizer found beside the weights (HF directory or GGUF metadata)."""

    def __init__(self, model_path: Path) -> None:
        from transformers import AutoTokenizer

        if model_path.is_file():  # GGUF: transformers rebuilds the fast tokenizer from the metadata
            self.hf = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                    local_files_only=True)
        else:
            self.hf = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
        self.vocab_size = len(self.hf)
        self.eos_token_id = self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the conversation plus the assistant turn header."""
        if self.hf.chat_template is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
        try:
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # jinja2 errors, template-raised exceptions
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas, cutting at stop strings.

    Never emits half a UTF-8 character (decoded text ending in U+FFFD waits for the next token), and
    holds back the last ``len(longest stop) - 1`` characters so a stop string is never streamed.
    """

    _CONTEXT = 5  # prompt tokens decoded as left context, so leading spaces come out right

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-self._CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.skip_special = skip_special_tokens
        self.text = ""  # all output text so far (cut at a stop string once one is found)
        self.emitted = 0  # characters of ``text`` already returned
        self.hold_back = max((len(s) for s in stop), default=1) - 1

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append one token; returns (text safe to emit now, whether a stop string was hit)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            search_from = max(len(self.text) - self.hold_back, 0)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            hits = [at for s in self.stop if (at := self.text.find(s, search_from)) != -1]
            if hits:
                self.text = self.text[:min(hits)]
                return self._take(len(self.text)), True
        return self._take(len(self.text) - self.hold_back), False

    def flush(self) -> str:
        """Whatever is held back, at the end of generation."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta
