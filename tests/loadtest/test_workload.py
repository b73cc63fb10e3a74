"""Workloads: exact prompt lengths as the target counts them, shared prefixes, datasets, seeding."""

from __future__ import annotations

import json

import pytest

from loadtest.workload import from_file, synthetic


def test_synthetic_prompts_have_exact_token_counts(smollm2_tokenizer):
    specs = synthetic(smollm2_tokenizer, 30, (5, 300), (4, 9), seed=3)
    for s in specs:
        assert len(smollm2_tokenizer.encode(s.prompt, add_special_tokens=False)) == s.prompt_tokens
        assert 5 <= s.prompt_tokens <= 300 and 4 <= s.max_tokens <= 9
    assert [s.prompt for s in specs] == [s.prompt for s in synthetic(smollm2_tokenizer, 30, (5, 300), (4, 9), seed=3)]


def test_shared_prefix_workload(smollm2_tokenizer):
    specs = synthetic(smollm2_tokenizer, 6, 100, 8, seed=0, prefix_len=64, num_prefixes=2)
    assert all(len(smollm2_tokenizer.encode(s.prompt, add_special_tokens=False)) == 100 for s in specs)
    heads = [smollm2_tokenizer.encode(s.prompt, add_special_tokens=False)[:48] for s in specs]
    assert heads[0] == heads[2] == heads[4] and heads[1] == heads[3] and heads[0] != heads[1]


def test_datasets_jsonl_sharegpt_alpaca(tmp_path, smollm2_tokenizer):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "hello there", "max_tokens": 7}\n{"prompt": "bye"}\n')
    specs = from_file(jsonl, smollm2_tokenizer, None, None)
    assert sorted((s.prompt, s.max_tokens) for s in specs) == [("bye", 128), ("hello there", 7)]

    share = tmp_path / "share.json"
    share.write_text(json.dumps([{"conversations": [{"from": "human", "value": "What is 2+2?"},
                                                    {"from": "gpt", "value": "It is four."}]},
                                 {"conversations": [{"from": "human", "value": "lonely"}]}]))
    (spec,) = from_file(share, smollm2_tokenizer, None, None)
    assert spec.prompt == "What is 2+2?" and spec.max_tokens == len(smollm2_tokenizer.encode("It is four."))

    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Summarise", "input": "a text", "output": "short"}]))
    (spec,) = from_file(alpaca, smollm2_tokenizer, None, 5)
    assert spec.prompt == "Summarise\n\na text" and spec.max_tokens == 5

    for name, content in [("bad.json", json.dumps([{"x": 1}])), ("broken.jsonl", '{"prompt": "a"}\n{oops\n'),
                          ("noprompt.jsonl", '{"text": "a"}\n'), ("object.json", '{"a": 1}')]:
        bad = tmp_path / name
        bad.write_text(content)
        with pytest.raises(ValueError, match=name):
            from_file(bad, smollm2_tokenizer, None, None)
