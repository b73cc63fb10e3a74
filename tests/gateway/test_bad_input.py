"""Every malformed request gets the right status and an OpenAI error body; nothing yields a 5xx."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import MODEL

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    # (id, path, body (dict, or bytes sent raw), status, param or None)
    ("chat-missing-model", CHAT, {"messages": MSG}, 400, "model"),
    ("chat-missing-messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("chat-empty-messages", CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat-messages-not-list", CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("chat-bad-role", CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("chat-content-number", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("chat-image-part", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("chat-unknown-model", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "model"),
    ("chat-model-number", CHAT, {"model": 3, "messages": MSG}, 400, "model"),
    ("chat-negative-max-tokens", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": -5}, 400, "max_tokens"),
    ("chat-zero-max-tokens", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("chat-huge-max-tokens", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 10**12}, 400, "input_tokens"),
    ("chat-max-tokens-string", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": "many"}, 400, "max_tokens"),
    ("chat-temperature-negative", CHAT, {"model": MODEL, "messages": MSG, "temperature": -0.1}, 400, "temperature"),
    ("chat-temperature-string", CHAT, {"model": MODEL, "messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("chat-top-p-zero", CHAT, {"model": MODEL, "messages": MSG, "top_p": 0}, 400, "top_p"),
    ("chat-top-p-big", CHAT, {"model": MODEL, "messages": MSG, "top_p": 1.01}, 400, "top_p"),
    ("chat-top-k", CHAT, {"model": MODEL, "messages": MSG, "top_k": -7}, 400, "top_k"),
    ("chat-min-p", CHAT, {"model": MODEL, "messages": MSG, "min_p": 3}, 400, "min_p"),
    ("chat-presence", CHAT, {"model": MODEL, "messages": MSG, "presence_penalty": 9}, 400, "presence_penalty"),
    ("chat-n-2-greedy", CHAT, {"model": MODEL, "messages": MSG, "n": 2, "temperature": 0}, 400, "n"),
    ("chat-n-over-max", CHAT, {"model": MODEL, "messages": MSG, "n": 129}, 400, "n"),
    ("chat-n-zero", CHAT, {"model": MODEL, "messages": MSG, "n": 0}, 400, "n"),
    ("chat-best-of", CHAT, {"model": MODEL, "messages": MSG, "best_of": 2}, 400, "best_of"),
    ("chat-logit-bias-out-of-vocab", CHAT, {"model": MODEL, "messages": MSG, "logit_bias": {"99999": 5}}, 400,
     "logit_bias"),
    ("chat-logit-bias-not-an-id", CHAT, {"model": MODEL, "messages": MSG, "logit_bias": {"abc": 5}}, 400,
     "logit_bias"),
    ("chat-unknown-field", CHAT, {"model": MODEL, "messages": MSG, "frobnicate": 3}, 400, "frobnicate"),
    ("chat-stream-options-without-stream", CHAT, {"model": MODEL, "messages": MSG,
                                                  "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat-message-unknown-key", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x", "x": 1}]},
     400, "messages"),
    ("chat-top-logprobs-no-flag", CHAT, {"model": MODEL, "messages": MSG, "top_logprobs": 2}, 400, None),
    ("chat-top-logprobs-huge", CHAT, {"model": MODEL, "messages": MSG, "logprobs": True, "top_logprobs": 99}, 400, "logprobs"),
    ("chat-seed-huge", CHAT, {"model": MODEL, "messages": MSG, "seed": 2**70}, 400, "seed"),
    ("chat-stop-not-strings", CHAT, {"model": MODEL, "messages": MSG, "stop": [1, 2]}, 400, "stop"),
    ("chat-stop-empty-string", CHAT, {"model": MODEL, "messages": MSG, "stop": [""]}, 400, "stop"),
    ("chat-stream-not-bool", CHAT, {"model": MODEL, "messages": MSG, "stream": "yes please"}, 400, "stream"),
    ("chat-min-tokens-over-max", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ("chat-stop-token-negative", CHAT, {"model": MODEL, "messages": MSG, "stop_token_ids": [-3]}, 400, "stop_token_ids"),
    ("comp-missing-prompt", COMP, {"model": MODEL}, 400, "prompt"),
    ("comp-empty-prompt", COMP, {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("comp-empty-token-list", COMP, {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("comp-token-out-of-vocab", COMP, {"model": MODEL, "prompt": [1, 2, 999999]}, 400, "prompt"),
    ("comp-token-negative", COMP, {"model": MODEL, "prompt": [-1]}, 400, "prompt"),
    ("comp-one-empty-prompt-of-two", COMP, {"model": MODEL, "prompt": [[1, 2], []]}, 400, "prompt"),
    ("comp-prompt-too-long", COMP, {"model": MODEL, "prompt": "hello " * 1100}, 400, "input_tokens"),
    ("comp-prompt-logprobs-streamed", COMP, {"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True},
     400, "prompt_logprobs"),
    ("comp-logprobs-huge", COMP, {"model": MODEL, "prompt": "x", "logprobs": 100}, 400, "logprobs"),
    # counts far past any deployment's bound are refused before anything is sized by them (a list of prompts x a
    # huge n once ended in OverflowError while the answer's writer was built)
    ("comp-prompts-times-huge-n", COMP, {"model": MODEL, "prompt": ["a", "b"], "n": 2**62}, 400, "n"),
    ("comp-huge-n", COMP, {"model": MODEL, "prompt": "a", "n": 10**30}, 400, "n"),
    ("chat-huge-n", CHAT, {"model": MODEL, "messages": MSG, "n": 2**63}, 400, "n"),
    ("comp-prompt-object", COMP, {"model": MODEL, "prompt": {"text": "x"}}, 400, "prompt"),
    ("invalid-json", COMP, b'{"model": "smollm2", "prompt": ', 400, None),
    ("json-array-body", COMP, b'[1, 2, 3]', 400, None),
    ("bad-utf8", COMP, b'{"model": "smollm2", "prompt": "\xff\xfe"}', 400, None),
    ("lone-surrogate", COMP, b'{"model": "smollm2", "prompt": "a\\ud800b"}', 400, "prompt"),
    ("oversize-body", COMP, {"model": MODEL, "prompt": "x" * 3_000_000}, 413, None),
    ("unknown-route", "/v1/engines", {"model": MODEL}, 404, None),
    ("tokenize-nothing", "/tokenize", {"model": MODEL}, 400, None),
    ("detokenize-bad-id", "/detokenize", {"model": MODEL, "tokens": [10**8]}, 400, "tokens"),
]


@pytest.mark.parametrize("name, path, body, status, param", CASES, ids=[c[0] for c in CASES])
def test_malformed_request(gateway_url, engine_idle, name, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(gateway_url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_wrong_method_is_405_in_openai_shape(gateway_url):
    r = httpx.get(f"{gateway_url}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
