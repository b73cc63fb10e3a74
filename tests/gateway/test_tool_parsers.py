"""Tool calling per deployment: the ``tool_parser`` a native deployment names decides the format calls are
forced and parsed in; without one, ``tool_choice`` other than "none" is refused as vLLM refuses it without
--tool-call-parser (vllm/renderers/online_renderer.py). Each test serves its own deployment (one engine
thread at a time on the shared engine)."""

from __future__ import annotations

import json

import httpx
import openai

from backends.native.config import EngineConfig
from tests.conftest import MODEL
from tests.gateway.test_tool_calls import ASK, TEMPLATE, TOOLS


def test_llama3_json_deployment(start_gateway, engine_idle):
    with start_gateway(backend_config=EngineConfig(tool_parser="llama3_json", chat_template=TEMPLATE)) as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
            r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          max_tokens=80, temperature=0, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name in ("get_weather", "get_time")
    json.loads(call.function.arguments)


def test_without_a_tool_parser_tool_choice_is_refused_as_vllm_does(start_gateway):
    with start_gateway() as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "tool_parser" in r.json()["error"]["message"]
        ok = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": TOOLS,
                                                            "tool_choice": "none", "max_tokens": 3})
        assert ok.status_code == 200
