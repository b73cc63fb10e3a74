"""n > 1, logit_bias, echo, prompt_logprobs and lists of prompts through the gateway with the openai SDK, shaped
as vLLM answers them (vllm/entrypoints/openai/completion/serving.py: choice i*n + j for prompt i's sample j,
usage summed; echo puts the prompt, and with logprobs its logprobs, before each choice)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import MODEL

ASK = [{"role": "user", "content": "Tell me a fun fact."}]


@pytest.fixture(scope="module")
def client(gateway_url):
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def test_n_4_with_a_seed_is_reproducible(client, engine_idle):
    kw = dict(model=MODEL, messages=ASK, n=4, seed=1234, temperature=1.0, max_tokens=16)
    first, again = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in first.choices}) > 1
    tokens = client.chat.completions.create(**kw, logprobs=True)
    per_choice = [len(c.logprobs.content) for c in tokens.choices]
    assert first.usage.completion_tokens == sum(per_choice)  # the prompt once, the samples summed
    assert first.usage.prompt_tokens == tokens.usage.prompt_tokens


def test_n_streamed_gives_each_choice_its_index(client, engine_idle):
    kw = dict(model=MODEL, messages=ASK, n=3, seed=99, temperature=1.0, max_tokens=12)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts, finishes = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                assert choice.index not in finishes, "a choice finishes once"
                finishes[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert sorted(finishes) == [0, 1, 2]
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [0, 1, 2]  # one opening chunk per choice, as vLLM sends
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_logit_bias_forces_and_forbids(client, native_engine):
    comma = native_engine.tokenizer.encode(",")[0]
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                       logit_bias={str(comma): 100})
    assert forced.choices[0].text == ",,,"
    free = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0)
    ids = native_engine.tokenizer.encode(free.choices[0].text)
    banned = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0,
                                       logit_bias={str(t): -100 for t in ids})
    assert not set(native_engine.tokenizer.encode(banned.choices[0].text)) & set(ids)
    clamped = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                        logit_bias={str(comma): 1e9})  # clamped to 100 (OpenAI's range)
    assert clamped.choices[0].text == ",,,"


def test_echo_puts_the_prompt_and_its_logprobs_first(client, native_engine, engine_idle):
    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2, temperature=0, echo=True,
                                       logprobs=1)
    choice = echoed.choices[0]
    assert choice.text == "Hello there" + plain.choices[0].text
    prompt = native_engine.tokenizer.encode("Hello there")
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    # vLLM reports them as prompt_logprobs too: token id -> logprob, rank, decoded token
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None
    entry = prompt_logprobs[1][str(prompt[1])]
    assert entry["decoded_token"] == lp.tokens[1] and entry["rank"] >= 1
    assert abs(entry["logprob"] - lp.token_logprobs[1]) < 1e-6


def test_echo_streamed(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0,
                                            echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith("Hello there")


def test_prompt_logprobs_on_completions(client, native_engine):
    r = client.completions.create(model=MODEL, prompt="One two three four", max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    prompt = native_engine.tokenizer.encode("One two three four")
    assert entries[0] is None and len(entries) == len(prompt)
    for token_id, entry in zip(prompt[1:], entries[1:]):
        assert str(token_id) in entry and 2 <= len(entry) <= 3  # the token itself and the top 2
        assert {1, 2} <= {e["rank"] for e in entry.values()}


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_gets_one_choice_per_prompt(client, stream, engine_idle):
    prompts = ["The sky is", "Water boils at", "My favourite food is"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0) for p in prompts]
    kw = dict(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    if stream:
        texts = {}
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunks[-1].usage
    else:
        r = client.completions.create(**kw)
        texts, usage = {c.index: c.text for c in r.choices}, r.usage
    assert [texts[i] for i in range(3)] == [s.choices[0].text for s in singles]
    assert usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_prompts_times_n_are_numbered_prompt_major(client):
    r = client.completions.create(model=MODEL, prompt=["Red", "Blue"], n=2, seed=5, temperature=1.0, max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = client.completions.create(model=MODEL, prompt="Blue", n=2, seed=5, temperature=1.0, max_tokens=4)
    assert [c.text for c in r.choices[2:]] == [c.text for c in alone.choices]


def test_raw_shape_of_n_and_errors(gateway_url):
    r = httpx.post(f"{gateway_url}/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2, "temperature": 0})
    assert r.status_code == 400 and "greedy" in r.json()["error"]["message"]
