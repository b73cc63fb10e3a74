"""The TGI adapter against a server speaking TGI's wire format (tests/fakes/tgi.py), which HF's
official ``text-generation`` client accepts too."""

from __future__ import annotations

import asyncio
import re

import pytest
import text_generation

from backends.base import (
    InvalidRequestError,
    OverloadedError,
    StructuredOutput,
    UnavailableError,
    UpstreamError,
)
from backends.http import TextServerConfig
from backends.tgi import TGIBackend
from tests.backends.adapters import collect
from tests.fakes.tgi import create_tgi_app
from tests.servers import serve_app

SCRIPT_WORDS = " The quick brown fox jumps over the lazy dog ."


@pytest.fixture(scope="module")
def tgi_url():
    with serve_app(create_tgi_app()) as url:
        yield url


def run(url: str, stream: bool = True, *, cfg=None, **kw):
    return collect(lambda: TGIBackend("toy", TextServerConfig(url=url, **(cfg or {}))), stream, **kw)


# ------------------------------------------------------------------------- the fake is TGI's format
def test_official_client_accepts_the_fake(tgi_url):
    client = text_generation.Client(tgi_url)
    reply = client.generate("hello there", max_new_tokens=3)
    assert reply.generated_text == " The quick brown"
    assert reply.details.finish_reason == text_generation.types.FinishReason.Length
    stream = list(client.generate_stream("hello there", max_new_tokens=20))
    assert "".join(r.token.text for r in stream if not r.token.special) == SCRIPT_WORDS
    assert stream[-1].details.finish_reason == text_generation.types.FinishReason.EndOfSequenceToken
    with pytest.raises(text_generation.errors.ValidationError, match="`temperature` must be strictly positive"):
        client.generate("hi", do_sample=True, temperature=0.0)


# --------------------------------------------------------------------------------- the adapter
@pytest.mark.parametrize("stream", [True, False])
def test_finish_reasons_text_and_usage(tgi_url, stream):
    chunks, text = run(tgi_url, stream, max_tokens=3, temperature=0.0)
    assert text == " The quick brown" and chunks[-1].finish_reason == "length"
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, 3)
    chunks, text = run(tgi_url, stream, max_tokens=30, temperature=0.0)  # eos_token → stop, EOS text dropped
    assert text == SCRIPT_WORDS and chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 11


@pytest.mark.parametrize("stream", [True, False])
def test_stop_string_is_cut_and_never_streamed(tgi_url, stream):
    chunks, text = run(tgi_url, stream, max_tokens=30, temperature=0.0, stop=[" fox"])
    assert text == " The quick brown" and chunks[-1].finish_reason == "stop"
    assert all("fox" not in c.text for c in chunks)


def test_streams_token_by_token_with_logprobs(tgi_url):
    chunks, _ = run(tgi_url, max_tokens=4, temperature=0.0, logprobs=2)
    assert [c.text for c in chunks] == [" The", " quick", " brown", " fox"]
    assert chunks[0].logprobs[0].token_id == 1000 and chunks[0].logprobs[0].logprob == -0.5
    assert len(chunks[0].logprobs[0].top) == 2


@pytest.mark.parametrize("params, error, message", [
    ({"max_tokens": 63}, InvalidRequestError, re.escape("`inputs` tokens + `max_new_tokens` must be <= 64")),
    ({"stop": ["a", "b", "c", "d", "e"]}, InvalidRequestError, "supports up to 4 stop sequences"),
    ({"min_p": 0.1}, InvalidRequestError, "min_p is not supported"),
    ({"ignore_eos": True}, InvalidRequestError, "ignore_eos is not supported"),
])
def test_validation_errors_are_client_errors(tgi_url, params, error, message):
    for stream in (True, False):
        with pytest.raises(error, match=message):
            run(tgi_url, stream, **params)


@pytest.mark.parametrize("structured, grammar", [
    (StructuredOutput("json", '{"type": "object"}', "response_format"), {"type": "json", "value": {"type": "object"}}),
    (StructuredOutput("json_object", param="response_format"), {"type": "json", "value": {"type": "object"}}),
    (StructuredOutput("regex", "[0-9]+"), {"type": "regex", "value": "[0-9]+"}),
    (StructuredOutput("choice", '["a.b", "c"]'), {"type": "regex", "value": "a\\.b|c"}),
])
def test_structured_outputs_go_as_tgis_grammar(structured, grammar):
    app = create_tgi_app()
    with serve_app(app) as url:
        run(url, max_tokens=2, structured=structured)
    assert app.state.parameters[-1]["grammar"] == grammar


@pytest.mark.parametrize("params, field", [
    ({"structured": StructuredOutput("grammar", "root ::= 'a'", "structured_outputs")}, "structured_outputs"),
    ({"n": 2, "temperature": 1.0}, "n"), ({"logit_bias": {5: 1.0}}, "logit_bias"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_what_tgi_cannot_honour_is_refused_naming_the_field(tgi_url, params, field):
    with pytest.raises(InvalidRequestError) as refused:
        run(tgi_url, **params)
    assert refused.value.param == field


def test_token_id_prompts_are_refused(tgi_url):
    with pytest.raises(InvalidRequestError, match="text prompts"):
        run(tgi_url, prompt=[1, 2, 3])


def test_failures_during_generation(tgi_url):
    with pytest.raises(UpstreamError, match="illegal memory access"):
        run(tgi_url, prompt="CRASH now", max_tokens=10)  # 424 before the reply / error event mid-stream
    with pytest.raises(UpstreamError, match="illegal memory access"):
        run(tgi_url, False, prompt="CRASH now", max_tokens=10)
    with pytest.raises((UpstreamError, UnavailableError)):
        run(tgi_url, prompt="CUT here", max_tokens=10)  # connection dropped mid-stream


def test_overload_is_retryable_429():
    with serve_app(create_tgi_app(max_concurrent=0)) as url:
        with pytest.raises(OverloadedError, match="Model is overloaded"):
            run(url, max_tokens=3)


def test_chat_through_tgis_openai_route_or_a_local_template(tgi_url, smollm2_path):
    messages = [{"role": "user", "content": "What is a fox?"}]
    chunks, text = run(tgi_url, messages=messages, max_tokens=3)  # chat: server → /v1/chat/completions
    assert chunks[-1].finish_reason == "length" and text
    chunks, text = run(tgi_url, messages=messages, max_tokens=3, temperature=0.0,
                       cfg={"chat": "template", "tokenizer": str(smollm2_path)})
    assert text == " The quick brown"
    assert chunks[-1].usage.prompt_tokens > 5  # the rendered template, not just the four words


def test_info_tokenize_and_health(tgi_url):
    async def main():
        adapter = TGIBackend("toy", TextServerConfig(url=tgi_url))
        try:
            return await adapter.health(), await adapter.info(), await adapter.tokenize("a b c")
        finally:
            await adapter.close()
    healthy, info, ids = asyncio.run(main())
    assert healthy and info.model_ids == ["toy/tgi"] and info.max_model_len == 64 and ids == [100, 101, 102]
