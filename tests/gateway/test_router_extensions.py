"""The extension fields the field's routers send on every request at their neutral values (SGLang's router and
vLLM's router: no_stop_trim, separate_reasoning, stream_reasoning, include_reasoning, return_hidden_states,
continue_final_message, skip_special_tokens, max_completion_tokens) are honoured by doing nothing, so burstgate
replicas can sit behind those routers; at other values they are what any unknown field is: refused with a 400
naming them by the native engine (and passed on to a server that takes them)."""

from __future__ import annotations

import httpx

from tests.conftest import MODEL

ROUTER_FIELDS = {"no_stop_trim": False, "separate_reasoning": True, "stream_reasoning": True, "include_reasoning": True,
                 "return_hidden_states": False, "skip_special_tokens": True}


def test_a_routers_neutral_fields_are_served_and_other_values_refused_by_name(start_gateway):
    with start_gateway() as (url, _):
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3,
            "continue_final_message": False, **ROUTER_FIELDS})
        text = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 3, **ROUTER_FIELDS})
        trimmed = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 3, "no_stop_trim": True})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 3
    assert text.status_code == 200
    assert trimmed.status_code == 400 and trimmed.json()["error"]["param"] == "no_stop_trim"
