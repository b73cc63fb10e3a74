"""Structured outputs on the native engine: xgrammar's bitmask in the batched sampler, the matcher advanced in
``Scheduler.postprocess``, grammars compiled once (LRU) and refused with a 400 naming the field when invalid.
What vLLM does is the reference (vllm/v1/structured_output/backend_xgrammar.py, the bitmask applied to the
logits before its sampler in vllm/v1/worker/gpu_model_runner.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from backends.base import InvalidRequestError, SamplingParams, StructuredOutput

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}


def _ask(engine, question: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])


def _json(schema: dict, **kw) -> SamplingParams:
    kw = {"max_tokens": 60, "temperature": 0.0, **kw}
    return SamplingParams(structured=StructuredOutput("json", json.dumps(schema), "response_format"), **kw)


def test_json_schema_output_is_valid_and_ends_with_stop(native_engine, engine_idle):
    (out,) = native_engine.generate([_ask(native_engine, "Describe a person.")], _json(PERSON))
    jsonschema.validate(json.loads(out.text), PERSON)
    assert out.finish_reason == "stop"


def test_regex_choice_grammar_and_json_object(native_engine, engine_idle):
    ask = _ask(native_engine, "Answer.")
    outs = native_engine.generate([ask] * 4, [
        SamplingParams(max_tokens=20, temperature=0.0, structured=StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}")),
        SamplingParams(max_tokens=20, temperature=0.0, structured=StructuredOutput("choice", '["red", "green"]')),
        SamplingParams(max_tokens=20, temperature=0.0,
                       structured=StructuredOutput("grammar", 'root ::= "The answer is " ("yes" | "no") "."')),
        SamplingParams(max_tokens=80, temperature=0.0, structured=StructuredOutput("json_object"),
                       stop=["\n\n\n"])])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[0].text)
    assert outs[1].text in ("red", "green")
    assert outs[2].text in ("The answer is yes.", "The answer is no.")
    assert outs[3].text.startswith("{")
    assert all(o.finish_reason == "stop" for o in outs[:3])


def test_a_cut_off_json_ends_with_length_as_vllm_does(native_engine, engine_idle):
    (out,) = native_engine.generate([_ask(native_engine, "Describe a person.")], _json(PERSON, max_tokens=5))
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_constrained_and_free_rows_share_a_batch_without_touching_each_other(native_engine, engine_idle):
    free_prompt = native_engine.tokenizer.encode("The capital of France is")
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (alone,) = native_engine.generate([free_prompt], free)
    mixed = native_engine.generate([free_prompt, _ask(native_engine, "Describe a person.")], [free, _json(PERSON)])
    assert mixed[0].token_ids == alone.token_ids
    jsonschema.validate(json.loads(mixed[1].text), PERSON)


def test_seeded_sampling_stays_reproducible_under_a_grammar(native_engine, engine_idle):
    params = _json(PERSON, temperature=1.0, seed=11)
    prompt = _ask(native_engine, "Describe a person.")
    first, second = native_engine.generate([prompt, prompt], [params, params])
    assert first.text == second.text
    jsonschema.validate(json.loads(first.text), PERSON)


def test_logprobs_and_stop_strings_work_under_a_grammar(native_engine, engine_idle):
    choice = StructuredOutput("choice", '["apple pie", "banana split"]')
    (out,) = native_engine.generate([_ask(native_engine, "Dessert?")], SamplingParams(
        max_tokens=10, temperature=0.0, logprobs=3, structured=choice))
    assert out.text in ("apple pie", "banana split")
    # The mask is applied before the logprobs (vLLM): the first token's alternatives are all allowed ones.
    assert all(any(c.startswith(text) for c in ("apple pie", "banana split")) for _, text, _ in out.logprobs[0].top)
    (cut,) = native_engine.generate([_ask(native_engine, "Dessert?")], SamplingParams(
        max_tokens=10, temperature=0.0, stop=[" "], structured=choice))
    assert cut.finish_reason == "stop" and cut.stop_reason == " " and " " not in cut.text


def test_grammars_are_compiled_once_per_constraint(native_engine):
    so = StructuredOutput("json", json.dumps({"type": "object", "properties": {"cache_probe": {"type": "integer"}}}))
    native_engine.compile_grammar(so)
    before = native_engine._grammars.compilations
    again = StructuredOutput("json", so.spec, "guided_json")  # another field, same constraint
    assert native_engine.compile_grammar(again) is native_engine.compile_grammar(so)
    assert native_engine._grammars.compilations == before


@pytest.mark.parametrize("so, fragment", [
    (StructuredOutput("json", '{"type": "nonsense"}', "response_format"), "nonsense"),
    (StructuredOutput("json", '{"type": "integer", "multipleOf": 3}', "response_format"), "multipleOf"),
    (StructuredOutput("regex", "(unclosed", "structured_outputs"), "parenthesis"),
    (StructuredOutput("grammar", "root ::= missing_rule", "guided_grammar"), "missing_rule"),
])
def test_invalid_constraints_are_refused_naming_the_field(native_engine, engine_idle, so, fragment):
    with pytest.raises(InvalidRequestError, match=fragment) as err:
        native_engine.compile_grammar(so)
    assert err.value.param == so.param
