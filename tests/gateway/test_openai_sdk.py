"""The official openai SDK against a real gateway: chat, completions, streaming with usage, typed errors."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import MODEL


@pytest.fixture(scope="module")
def client(gateway_url):
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_completion(client, engine_idle):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_content_as_text_parts_equals_string(client):
    kw = dict(model=MODEL, max_tokens=8, temperature=0)
    as_string = client.chat.completions.create(messages=[{"role": "user", "content": "Name a colour."}], **kw)
    as_parts = client.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}], **kw)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content


def test_completion_with_vllm_extras(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "top_k": 5, "min_tokens": 6, "repetition_penalty": 1.0})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.choices[0].text.startswith(" 5")


def test_completion_token_id_prompt(client, native_engine):
    ids = native_engine.tokenizer.encode("The sky is")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_streaming_chat_with_usage(client, engine_idle):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                            max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens > 0
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason in ("stop", "length")
    folded = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                            max_tokens=20, temperature=0)
    assert text == folded.choices[0].message.content


def test_streaming_completion_without_usage_has_none(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, stream=True))
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks)


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    c = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.token_logprobs) == 3


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=12, temperature=1.0, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_errors_are_typed_sdk_exceptions(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 1100, max_tokens=10)
    assert "maximum context length is 1024 tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=3)


def test_tokenize_and_detokenize(gateway_url, native_engine):
    import httpx

    r = httpx.post(f"{gateway_url}/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == native_engine.tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 1024 and "".join(body["token_strs"]) == "Hello world"
    chat = httpx.post(f"{gateway_url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 5
    back = httpx.post(f"{gateway_url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json()
    assert back == {"prompt": "Hello world"}


def test_health_ready_docs(gateway_url):
    import httpx

    assert httpx.get(f"{gateway_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{gateway_url}/ready").json() == {"ready": True, "models": {MODEL: True}, "draining": False}
    spec = httpx.get(f"{gateway_url}/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"]
    assert httpx.get(f"{gateway_url}/docs").status_code == 200
