"""Hypothesis on the request models (gateway/wire/requests.py), alone and through a real server and engine:
whatever JSON arrives (huge integers, NaN and infinities, which Python's JSON parser accepts, wrong types),
the answer is a model or a 400 naming the field, never a 5xx, and one bad request never fails others."""

from __future__ import annotations

import contextlib
import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from backends.base import InvalidRequestError, SamplingParams
from gateway.wire.requests import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tests.conftest import MODEL

HUGE = st.integers(min_value=-(2**70), max_value=2**70)
EDGES = st.sampled_from([49_151, 49_152, 100_000, 2**31, 2**63 - 1, 2**63, 2**64])  # SmolLM2's vocab is 49,152
INTS = st.one_of(st.integers(-2, 4), EDGES, HUGE)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),  # and values that underflow or overflow in fp32
                   st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.0, 1e-300, 1e-6, 1e300]))
JSON = st.recursive(st.none() | st.booleans() | INTS | FLOATS | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)
SAMPLING = {"temperature": FLOATS, "top_p": FLOATS, "top_k": INTS, "min_p": FLOATS, "seed": INTS,
            "presence_penalty": FLOATS, "frequency_penalty": FLOATS, "repetition_penalty": FLOATS,
            "min_tokens": INTS, "stop_token_ids": st.lists(INTS, max_size=3), "ignore_eos": st.booleans(),
            "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)), "n": INTS,
            "skip_special_tokens": st.booleans(), "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                                  "continuous_usage_stats": st.booleans()})}
PROMPT = st.one_of(st.text(max_size=16), st.lists(st.integers(-5, 60_000), max_size=4))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"])},
                                          optional={"content": st.one_of(st.text(max_size=16), st.none())}),
                    min_size=1, max_size=3)
MAX_TOKENS = st.one_of(st.integers(1, 3), HUGE)  # always given: a request without it may run for 1000 tokens
COMPLETION = st.fixed_dictionaries({"model": st.just(MODEL), "prompt": PROMPT, "max_tokens": MAX_TOKENS},
                                   optional={**SAMPLING, "logprobs": INTS})
CHAT = st.fixed_dictionaries({"model": st.just(MODEL), "messages": MESSAGES, "max_tokens": MAX_TOKENS},
                             optional={**SAMPLING, "logprobs": st.booleans(), "top_logprobs": INTS})
# Through the server: prompts the engine takes, so that the sampling values reach it, and few tokens.
SERVED = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": st.text(min_size=1, max_size=12), "max_tokens": st.integers(1, 3),
     "min_tokens": st.integers(0, 3)},
    optional={**{k: v for k, v in SAMPLING.items() if k != "min_tokens"}, "logprobs": INTS}) | CHAT
FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
FUZZ_SERVER = settings(FUZZ, max_examples=80)


def _valid_params(params: SamplingParams) -> None:
    """What a request that passed validation hands the engine: finite floats and int64 integers."""
    for value in vars(params).values():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, float):
                assert math.isfinite(v)
            elif isinstance(v, int):
                assert -(2**63) <= v < 2**63


@pytest.mark.parametrize("model, strategy", [
    (CompletionRequest, st.one_of(COMPLETION, st.dictionaries(st.sampled_from([*SAMPLING, "prompt", "model"]), JSON))),
    (ChatCompletionRequest, st.one_of(CHAT, st.dictionaries(st.sampled_from([*SAMPLING, "messages", "model"]), JSON))),
])
def test_generation_requests_are_a_model_or_a_clear_refusal(model, strategy):
    @FUZZ
    @given(body=strategy)
    def check(body):
        try:
            request = model.model_validate(body)
            _valid_params(request.to_sampling_params())
            request.generation_requests("x") if model is CompletionRequest else request.generation_request("x")
        except (ValidationError, InvalidRequestError):
            pass

    check()


@given(body=st.dictionaries(st.sampled_from(["model", "prompt", "messages", "tokens", "add_special_tokens",
                                             "return_token_strs"]), JSON))
@FUZZ
def test_tokenizer_requests_are_a_model_or_a_clear_refusal(body):
    for model in (TokenizeRequest, DetokenizeRequest):
        with contextlib.suppress(ValidationError):  # a refusal is fine; anything else fails the test
            model.model_validate(body)


def _no_server_error(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:300]
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events[:-1]), r.text[-300:]
    elif r.status_code >= 400:
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_no_sampling_value_makes_a_server_error_or_fails_other_requests(gateway_url, engine_idle):
    with httpx.Client(base_url=gateway_url, timeout=30) as client:
        @FUZZ_SERVER
        @given(body=SERVED)
        def check(body):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            _no_server_error(client.post(path, content=json.dumps(body), headers={"content-type": "application/json"}))

        check()
        # the engine still serves a plain request afterwards
        ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200


@pytest.mark.parametrize("fields, status", [  # what this fuzzing found: each once failed every request in its batch
    ({"min_tokens": 2, "stop_token_ids": [100_000]}, 400),  # stop ids past the vocabulary, masked during min_tokens
    ({"top_k": 2**64}, 400),  # past int64: the sampler's tensor cannot hold it
    ({"temperature": 1e-300}, 200),  # under vLLM's 1e-5: greedy, not a division overflowing to inf
    ({"repetition_penalty": 1e-300}, 200),  # penalised logits overflow: the row's most likely token
    ({"top_p": 1e-300}, 200),  # 0 in fp32: every token dropped
])
def test_values_the_fuzzing_found(gateway_url, fields, status):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, **fields}
    assert httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=30).status_code == status
