"""A GGUF's tokenizer, rebuilt by transformers from the file's metadata (seconds), is kept in the cache once
(backends/cache.py) and read from there afterwards: the same tokenizer, for every later server start."""

from __future__ import annotations

from backends.native.weights import default_model_path
from backends.tokenizer import _gguf_tokenizer

TEXTS = ["Hello world, how are you?", "Ünïcödé 日本語 🙂", "  spaces   and\ttabs\n"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_a_gguf_tokenizer_is_rebuilt_once_then_read_from_the_cache_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("BURSTGATE_CACHE_DIR", str(tmp_path))
    gguf = default_model_path()
    rebuilt = _gguf_tokenizer(gguf)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    assert (entry / "tokenizer.json").exists()
    cached = _gguf_tokenizer(gguf)
    assert cached.name_or_path == str(entry)  # read from the cache, not rebuilt
    assert [rebuilt.encode(t) for t in TEXTS] == [cached.encode(t) for t in TEXTS]
    assert rebuilt.apply_chat_template(CHAT, add_generation_prompt=True) == cached.apply_chat_template(
        CHAT, add_generation_prompt=True)
    assert (rebuilt.eos_token_id, len(rebuilt), rebuilt.clean_up_tokenization_spaces) == (
        cached.eos_token_id, len(cached), cached.clean_up_tokenization_spaces)


def test_without_a_writable_cache_the_tokenizer_is_still_built(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache would be a folder below a file: it cannot be made, even by root
    monkeypatch.setenv("BURSTGATE_CACHE_DIR", str(blocker / "cache"))
    tokenizer = _gguf_tokenizer(default_model_path())
    assert tokenizer.decode(tokenizer.encode("Hello there"), skip_special_tokens=True) == "Hello there"
