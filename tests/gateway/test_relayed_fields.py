"""Every field the native engine honours reaches it through an OpenAI-compatible deployment: a gateway whose
deployment is the OpenAI adapter, in front of a burstgate serving the native engine (tool parser hermes),
answers exactly what that upstream answers when asked directly, with the official openai SDK both times.
Nothing is dropped on the way: n, logit_bias, prompt_logprobs, echo, structured outputs (response_format
and vLLM's structured_outputs), tools and tool_choice, and fields the gateway does not interpret."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.config import OpenAIDeployment, Settings
from gateway.service import Gateway
from tests.conftest import MODEL
from tests.servers import serve_app

TEMPLATE = str(Path(__file__).resolve().parents[2] / "configs" / "chat_templates" / "chatml_tools.jinja")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Tell me about a person."}]


@pytest.fixture(scope="module")
def clients(start_gateway):
    """(direct, relayed): SDK clients of the upstream itself and of a gateway relaying to it."""
    with start_gateway(backend_config=EngineConfig(tool_parser="hermes", chat_template=TEMPLATE)) as (upstream, _):
        deployment = OpenAIDeployment(kind="openai", name="up", url=f"{upstream}/v1", upstream_model=MODEL)
        settings = Settings(models=[{"name": MODEL, "deployments": [deployment]}])
        with serve_app(create_app(Gateway.from_settings(settings))) as relay:
            yield (openai.OpenAI(base_url=f"{upstream}/v1", api_key="x", max_retries=0),
                   openai.OpenAI(base_url=f"{relay}/v1", api_key="x", max_retries=0))


def _both(clients, create: str, **body) -> list[dict]:
    """The same request to the upstream and through the relay, as plain dicts without ids, times and cached
    tokens (the second ask finds the first's prompt in the prefix cache)."""
    answers = []
    for client in clients:
        api = client.chat.completions if create == "chat" else client.completions
        reply = api.create(model=MODEL, **body).model_dump(exclude={"id", "created"})
        reply["usage"].pop("prompt_tokens_details")
        for choice in reply["choices"]:
            for call in (choice.get("message") or {}).get("tool_calls") or []:
                call.pop("id")  # fresh per answer, in vLLM's shape
        answers.append(reply)
    return answers


def test_n_seeded_samples_and_logit_bias_are_relayed(clients):
    direct, relayed = _both(clients, "completion", prompt="Once upon a time", max_tokens=6, n=3, seed=7,
                            temperature=1.0, logit_bias={"0": -100}, logprobs=1)
    assert len(relayed["choices"]) == 3 and relayed == direct


def test_echo_and_prompt_logprobs_are_relayed(clients):
    direct, relayed = _both(clients, "completion", prompt="The sky is", max_tokens=3, temperature=0, echo=True,
                            logprobs=0, extra_body={"prompt_logprobs": 1})
    assert relayed["choices"][0]["text"].startswith("The sky is") and relayed["choices"][0]["prompt_logprobs"]
    assert relayed == direct


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
    {"response_format": {"type": "json_object"}},
    {"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}},
    {"extra_body": {"structured_outputs": {"regex": "[A-Z][a-z]{2,6}", "disable_any_whitespace": True}}},
], ids=["json_schema", "json_object", "choice", "regex"])
def test_structured_outputs_are_relayed(clients, constraint):
    direct, relayed = _both(clients, "chat", messages=ASK, max_tokens=40, temperature=0, **constraint)
    assert relayed == direct
    content = relayed["choices"][0]["message"]["content"]
    if "response_format" in constraint and relayed["choices"][0]["finish_reason"] == "stop":
        json.loads(content)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tools_and_forced_calls_are_relayed(clients, tool_choice):
    direct, relayed = _both(clients, "chat", messages=[{"role": "user", "content": "Weather in Paris?"}],
                            tools=[WEATHER], tool_choice=tool_choice, max_tokens=60, temperature=0)
    (call,) = relayed["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
    assert relayed == direct


def test_a_field_the_gateway_does_not_interpret_reaches_the_upstream_and_its_refusal_comes_back(clients):
    _, relay = clients
    with pytest.raises(openai.BadRequestError) as refused:
        relay.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"frobnicate": 1})
    assert refused.value.status_code == 400 and "frobnicate" in str(refused.value)
