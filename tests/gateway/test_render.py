"""vLLM's render routes (``/v1/chat/completions/render``, ``/v1/completions/render``): the request as the engine will
get it: the very token ids the generation prefills (through the chat template and its tools section for chats),
and the sampling parameters under vLLM's names (the shape checked against real vLLM in
tests/peers/test_vllm_render.py). Bad input is refused as the generation routes refuse it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from backends.native.config import EngineConfig
from tests.conftest import MODEL

TEMPLATE = str(Path(__file__).resolve().parents[2] / "configs" / "chat_templates" / "chatml_tools.jinja")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def url(start_gateway):
    with start_gateway(backend_config=EngineConfig(tool_parser="hermes", chat_template=TEMPLATE)) as (url, _):
        yield url


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60)


def test_a_chat_renders_to_the_tokens_its_generation_prefills(url, engine_idle):
    for tools in (None, [WEATHER]):
        extra = {"tools": tools} if tools else {}
        rendered = post(url, "/v1/chat/completions/render", messages=CHAT, max_tokens=4, **extra).json()
        answer = post(url, "/v1/chat/completions", messages=CHAT, max_tokens=4, **extra).json()
        tokenized = post(url, "/tokenize", messages=CHAT, **extra).json()
        assert rendered["token_ids"] == tokenized["tokens"]
        assert len(rendered["token_ids"]) == answer["usage"]["prompt_tokens"]
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["model"] == MODEL
    assert rendered["output_mode"] == "tokens" and rendered["stream"] is False


def test_each_prompt_renders_apart_and_token_prompts_as_they_are(url):
    answers = post(url, "/v1/completions/render", prompt=["The sky is", "Two and two"], max_tokens=4).json()
    assert [a["token_ids"] for a in answers] == [post(url, "/tokenize", prompt=p).json()["tokens"]
                                                 for p in ("The sky is", "Two and two")]
    base = answers[0]["request_id"].removesuffix("-0")
    assert base.startswith("cmpl-") and answers[1]["request_id"] == f"{base}-1"
    (ids,) = post(url, "/v1/completions/render", prompt=[1, 2, 3], max_tokens=4).json()
    assert ids["token_ids"] == [1, 2, 3]


def test_sampling_parameters_under_vllms_names(url):
    greedy = post(url, "/v1/chat/completions/render", messages=CHAT, temperature=0).json()
    info = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    params = greedy["sampling_params"]
    assert params["max_tokens"] == info["max_model_len"] - len(greedy["token_ids"])  # to the context's end
    assert params["temperature"] == 0 and "top_p" not in params  # greedy: vLLM resets top-p and min-p
    assert params["output_kind"] == 2  # vLLM's FINAL_ONLY for a whole answer
    sampled = post(url, "/v1/completions/render", prompt="Hi", max_tokens=5, temperature=0.7, top_p=0.9, top_k=20,
                   seed=3, stop=["."], n=2, stream=True, ignore_eos=True, logprobs=2,
                   response_format={"type": "json_object"}).json()[0]["sampling_params"]
    assert {k: sampled[k] for k in ("n", "temperature", "top_p", "top_k", "seed", "stop", "max_tokens", "ignore_eos",
                                    "logprobs", "output_kind", "structured_outputs")} == {
        "n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 3, "stop": ["."], "max_tokens": 5,
        "ignore_eos": True, "logprobs": 2, "output_kind": 1, "structured_outputs": {"json_object": True}}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/chat/completions/render", {"model": "no-such-model", "messages": CHAT}, 404, "model"),
    ("/v1/chat/completions/render", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions/render", {"messages": CHAT, "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/chat/completions/render", {"messages": CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/completions/render", {"prompt": "word " * 3000}, 400, "input_tokens"),
    ("/v1/completions/render", {"prompt": "Hi", "max_tokens": 10**6}, 400, "input_tokens"),
])
def test_bad_input_is_refused_as_the_generation_routes_refuse_it(url, path, body, status, param):
    r = post(url, path, **body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
