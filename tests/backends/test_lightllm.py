"""The LightLLM adapter against a server speaking LightLLM's wire format (tests/fakes/lightllm.py)."""

from __future__ import annotations

import pytest

from backends.base import InvalidRequestError, OverloadedError, UnavailableError
from backends.http import TextServerConfig
from backends.lightllm import LightLLMBackend
from tests.backends.adapters import collect
from tests.fakes.lightllm import create_lightllm_app
from tests.servers import serve_app

SCRIPT_WORDS = " The quick brown fox jumps over the lazy dog ."


@pytest.fixture(scope="module")
def url():
    with serve_app(create_lightllm_app()) as url:
        yield url


def run(url: str, stream: bool = True, **kw):
    return collect(lambda: LightLLMBackend("toy", TextServerConfig(url=url)), stream, **kw)


@pytest.mark.parametrize("stream", [True, False])
def test_finish_reasons_text_usage_and_stop_strings(url, stream):
    chunks, text = run(url, stream, max_tokens=3, temperature=0.0)
    assert text == " The quick brown" and chunks[-1].finish_reason == "length"
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, 3)
    chunks, text = run(url, stream, max_tokens=30, temperature=0.0)
    assert text == SCRIPT_WORDS and chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 11
    chunks, text = run(url, stream, max_tokens=30, temperature=0.7, stop=[" over"])
    assert text == " The quick brown fox jumps" and chunks[-1].finish_reason == "stop"


def test_streams_token_by_token(url):
    chunks, _ = run(url, max_tokens=3)
    assert [c.text for c in chunks] == [" The", " quick", " brown"] and chunks[0].token_ids == [1000]


@pytest.mark.parametrize("params, error, message", [
    ({"presence_penalty": -1.0}, InvalidRequestError, "presence_penalty must >= 0.0"),
    ({"repetition_penalty": 0.5}, InvalidRequestError, "repetition_penalty must >= 1.0"),
    ({"seed": 3}, InvalidRequestError, "seed is not supported by LightLLM"),
])
def test_invalid_parameters_are_client_errors(url, params, error, message):
    for stream in (True, False):
        with pytest.raises(error, match=message):
            run(url, stream, **params)


def test_busy_server_is_overloaded_and_a_cut_stream_is_an_upstream_error(url):
    with serve_app(create_lightllm_app(busy=True)) as busy:
        with pytest.raises(OverloadedError, match="server is busy"):
            run(busy, max_tokens=3)
    with pytest.raises(UnavailableError, match="unreachable: ClientPayloadError"):
        run(url, prompt="CRASH", max_tokens=5)  # LightLLM drops the stream when generation raises


def test_chat_goes_to_lightllms_openai_route(url):
    chunks, text = run(url, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert text == " tok tok" and chunks[-1].finish_reason == "length"
