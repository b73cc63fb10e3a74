"""The stop rules on the native engine are vLLM's (vllm/v1/core/sched/utils.py ``check_stop``, and the
detokenizer's stop strings in vllm/v1/engine/detokenizer.py; the same requests are sent to real vLLM in
tests/peers/test_vllm.py): a stop token ends with "stop" and its text is left out while its id is kept;
stop strings only count in text generated after ``min_tokens``; the length limit gives "length"."""

from __future__ import annotations

import pytest

from backends.base import InvalidRequestError, SamplingParams

PROMPT = "Write a short story about a robot who learns to paint."


def _greedy(engine, prompt_ids, **params):
    (out,) = engine.generate([prompt_ids], SamplingParams(temperature=0.0, **params))
    return out


def test_a_stop_token_ends_with_stop_and_its_text_is_left_out(native_engine, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode(PROMPT)
    free = _greedy(native_engine, prompt, max_tokens=12, ignore_eos=True)
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = _greedy(native_engine, prompt, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[:first + 1]  # the stop token's id is in the output
    assert out.text == smollm2_tokenizer.decode(free.token_ids[:first])  # its text is not
    assert out.usage.completion_tokens == first + 1


def test_stop_strings_count_only_after_min_tokens(native_engine, smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode(PROMPT)
    free = _greedy(native_engine, prompt, max_tokens=40, ignore_eos=True)
    early = smollm2_tokenizer.decode(free.token_ids[2:3]).strip() or smollm2_tokenizer.decode(free.token_ids[3:4])
    stopped = _greedy(native_engine, prompt, max_tokens=40, ignore_eos=True, stop=[early])
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 4
    # With min_tokens past it, the early occurrence does not stop generation.
    held = _greedy(native_engine, prompt, max_tokens=40, ignore_eos=True, stop=[early], min_tokens=8)
    assert len(held.token_ids) >= 8
    assert held.text.startswith(stopped.text + early)


def test_the_length_limit_ends_with_length(native_engine, smollm2_tokenizer):
    out = _greedy(native_engine, smollm2_tokenizer.encode(PROMPT), max_tokens=3, ignore_eos=True)
    assert (out.finish_reason, len(out.token_ids), out.usage.completion_tokens) == ("length", 3, 3)


def test_without_detokenizing_the_same_tokens_come_without_text(native_engine, smollm2_tokenizer):
    """vLLM's ``detokenize: false`` (the virtual fleet's requests): token ids and stops as before, no text made;
    stop strings, which need the text, are refused with vLLM's words."""
    prompt = smollm2_tokenizer.encode(PROMPT)
    text = _greedy(native_engine, prompt, max_tokens=8, ignore_eos=True)
    ids_only = _greedy(native_engine, prompt, max_tokens=8, ignore_eos=True, detokenize=False)
    assert ids_only.token_ids == text.token_ids and ids_only.finish_reason == text.finish_reason == "length"
    assert text.text and ids_only.text == ""
    with pytest.raises(InvalidRequestError, match="detokenize"):
        SamplingParams(stop=["."], detokenize=False).validate()
