"""Tokenizer, chat template and incremental detokenisation, for in-process engines and chat templating of
servers that only take text."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from backends.base import InvalidRequestError
from backends.cache import cache_dir

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _load_hf_tokenizer(model_path: Path):
    """The HF fast tokenizer of a model, loaded once per process: rebuilding one from a GGUF's metadata
    takes seconds, and nothing here modifies it (chat templates are passed per call)."""
    from transformers import AutoTokenizer

    if model_path.is_file():  # GGUF: transformers rebuilds the fast tokenizer from the metadata
        return _gguf_tokenizer(model_path)
    return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)


def _gguf_tokenizer(model_path: Path):
    """A GGUF's tokenizer as transformers rebuilds it from the metadata (about 10 s for SmolLM2's on a 2-core
    machine), saved once in the cache and read from there afterwards (a fraction of a second): every later start
    of a server or a replica is that much faster. Keyed by the file (path, size, modification time) and the
    transformers version that rebuilt it; without a writable cache it is rebuilt each time."""
    import transformers
    from transformers import AutoTokenizer

    stat = model_path.stat()
    key = hashlib.sha256(f"{model_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
                         .encode()).hexdigest()[:24]
    cached = cache_dir() / "tokenizers" / key
    if (cached / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
        except Exception as exc:  # written by a tokenizers release that this one cannot read: rebuilt below
            log.warning("cached tokenizer %s unreadable (%s): rebuilding it from %s", cached, exc, model_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name, local_files_only=True)
    try:  # written beside, then renamed: a reader never sees half a tokenizer
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent) as scratch:
            tokenizer.save_pretrained(scratch)
            os.replace(scratch, cached)
            os.mkdir(scratch)  # for TemporaryDirectory's own clean-up
    except OSError as exc:  # no writable cache (or another process won the race): nothing lost
        log.debug("tokenizer of %s not cached: %s", model_path.name, exc)
    return tokenizer


class Tokenizer:
    """Wraps the HF fast tokenizer found beside the weights (HF directory or GGUF metadata)."""

    def __init__(self, model_path: Path) -> None:
        self.hf = _load_hf_tokenizer(model_path)
        self.vocab_size = len(self.hf)
        self.eos_token_id = self.hf.eos_token_id
        # The Rust tokenizer itself, when transformers' decode would add nothing to it: faster per call
        # (docs/performance.md), and incremental detokenisation decodes twice per generated token.
        self._rust = None if self.hf.clean_up_tokenization_spaces else getattr(self.hf, "backend_tokenizer", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._rust is not None:
            return self._rust.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            template: str | None = None) -> list[int]:
        """Token ids of the conversation (and the ``tools`` it may call) plus the assistant turn header;
        ``template`` replaces the model's own chat template."""
        ids = self._chat_template(messages, tools, template, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The conversation plus the assistant turn header as text, for servers that take only text."""
        return self._chat_template(messages, None, None, tokenize=False)

    def _chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       template: str | None, tokenize: bool):
        if template is None and self.hf.chat_template is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
        try:
            return self.hf.apply_chat_template(messages, tools=tools, chat_template=template,
                                               add_generation_prompt=True, tokenize=tokenize)
        except Exception as exc:  # jinja2 errors, template-raised exceptions
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc


class IncrementalDetokenizer:
    """Turns output ids into text deltas, one token at a time.

    The tokenizers library's ``DecodeStream`` does the work in Rust, one call per token (vLLM's
    ``FastIncrementalDetokenizer``), seeded with the prompt's last tokens so that the first delta's
    leading space comes out right; it never emits half a UTF-8 character.
    """

    _CONTEXT = 5  # prompt tokens the stream starts from

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._rust = tokenizer.hf.backend_tokenizer
        self._stream = DecodeStream(ids=list(prompt_ids[-self._CONTEXT:]), skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> str:
        """The text that ``token_id`` completes (empty while a character is incomplete)."""
        return self._stream.step(self._rust, token_id) or ""
