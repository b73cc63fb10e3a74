"""``/v1/responses`` through the real openai SDK against a real gateway and the native engine: the same answer as
chat completions for the same conversation, streamed events the SDK's helpers accept, stored turns continued
with ``previous_response_id`` (and routed to the replica that holds them), background responses, per-key
isolation, tools and structured outputs, bad input as 400s and 404s, the store shared through a real Redis."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.config import Settings
from gateway.deployments import Deployment
from gateway.limits import ConcurrencyLimiter
from gateway.routing import ModelGroup
from gateway.routing.round_robin import RoundRobinConfig
from gateway.service import Gateway
from tests.conftest import MODEL
from tests.servers import redis_server, serve_app

TEMPLATE = str(Path(__file__).resolve().parents[3] / "configs" / "chat_templates" / "chatml_tools.jinja")
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}


def sdk(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def served(start_gateway):
    with start_gateway() as (url, gateway):
        yield url, gateway


@pytest.fixture(scope="module")
def client(served):
    with sdk(served[0]) as c:
        yield c


def chat_answer(client, messages, max_tokens=12):
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens)
    return r.choices[0].message.content, r.usage


# ---------------------------------------------------------------------------------------- create
def test_answers_as_chat_completions_do_for_the_same_conversation(client, engine_idle):
    r = client.responses.create(input="What is the capital of France?", instructions="Answer in one word.", **GREEDY)
    text, usage = chat_answer(client, [{"role": "system", "content": "Answer in one word."},
                                       {"role": "user", "content": "What is the capital of France?"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == text and "Paris" in text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.output[0].type == "message" and r.output[0].role == "assistant" and r.output[0].status == "completed"
    assert (r.instructions, r.model, r.temperature, r.store) == ("Answer in one word.", MODEL, 0.0, True)


def test_cut_by_max_output_tokens_is_incomplete(client, engine_idle):
    r = client.responses.create(input="Tell me a long story about a dragon.", **{**GREEDY, "max_output_tokens": 3})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_streamed_events_fold_to_the_same_response_through_the_sdks_helper(client, engine_idle):
    whole = client.responses.create(input="Name three colours.", **GREEDY)
    kinds, deltas = [], []
    with client.responses.stream(input="Name three colours.", **GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text == "".join(deltas)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}


def test_raw_stream_numbers_its_events_and_names_each_on_its_event_line(served, engine_idle):
    with httpx.stream("POST", f"{served[0]}/v1/responses", json={**GREEDY, "input": "Hi", "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[::2]]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert names == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


# ------------------------------------------------------------------------------- conversations
def test_previous_response_id_continues_the_conversation(client, engine_idle):
    first = client.responses.create(input="My name is Ada. Say hello.", instructions="Be brief.", **GREEDY)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, **GREEDY)
    text, usage = chat_answer(client, [{"role": "user", "content": "My name is Ada. Say hello."},
                                       {"role": "assistant", "content": first.output_text},
                                       {"role": "user", "content": "What is my name?"}])
    assert second.output_text == text  # instructions are not carried to the next turn (OpenAI's rule)
    assert second.usage.input_tokens == usage.prompt_tokens
    assert second.previous_response_id == first.id and second.instructions is None


def test_the_next_turn_reuses_the_cached_history(client, engine_idle):
    story = "My name is Ada and I live in a small house by the sea with two cats. " * 4
    first = client.responses.create(input=story + "Say hello.", instructions="Be brief.", **GREEDY)
    second = client.responses.create(input="What is my name?", instructions="Be brief.",
                                     previous_response_id=first.id, **GREEDY)
    assert first.usage.input_tokens > 64  # at least one full KV block (64 tokens on CPU) to reuse
    assert second.usage.input_tokens_details.cached_tokens >= 64


def test_stored_responses_are_retrieved_listed_and_deleted(client, engine_idle):
    r = client.responses.create(input=[{"role": "user", "content": "Hi"}], metadata={"ticket": "42"}, **GREEDY)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"ticket": "42"}
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Hi")]
    assert items.data[0].id.startswith("msg_")
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="And?", previous_response_id=r.id, **GREEDY)


def test_store_false_keeps_nothing(client, engine_idle):
    r = client.responses.create(input="Hi", store=False, **GREEDY)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


# ----------------------------------------------------------------------------------- background
def _wait(client, rid, statuses=("completed", "incomplete", "cancelled", "failed"), timeout=120):
    deadline = time.monotonic() + timeout
    while (r := client.responses.retrieve(rid)).status not in statuses:
        assert time.monotonic() < deadline, f"still {r.status}"
        time.sleep(0.1)
    return r


def test_background_responses_are_queued_then_polled_to_completion(client, engine_idle):
    queued = client.responses.create(input="Name a fruit.", background=True, **GREEDY)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _wait(client, queued.id)
    assert done.status in ("completed", "incomplete") and done.output_text
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(client.responses.create(input="Hi", **GREEDY).id)


def test_cancelling_a_background_response_stops_its_generation(client, engine_idle):
    r = client.responses.create(input="Count to a thousand.", background=True, model=MODEL, temperature=0,
                                max_output_tokens=900, extra_body={"ignore_eos": True})
    _wait(client, r.id, ("in_progress",))
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == "cancelled"  # again: as it is


# ------------------------------------------------------------------------------------ per key
def test_one_key_never_reads_or_continues_anothers_responses(start_gateway, engine_idle):
    keys = [{"name": "alice", "key": "sk-alice"}, {"name": "bob", "key": "sk-bob"}]
    with start_gateway(api_keys=keys) as (url, _), sdk(url, "sk-alice") as alice, sdk(url, "sk-bob") as bob:
        r = alice.responses.create(input="Hi", **GREEDY)
        assert alice.responses.retrieve(r.id).id == r.id
        for attempt in (lambda: bob.responses.retrieve(r.id), lambda: bob.responses.delete(r.id),
                        lambda: bob.responses.cancel(r.id), lambda: bob.responses.input_items.list(r.id),
                        lambda: bob.responses.create(input="And?", previous_response_id=r.id, **GREEDY)):
            with pytest.raises(openai.NotFoundError):
                attempt()
        assert alice.responses.retrieve(r.id).id == r.id


# ------------------------------------------------------------------------------ tools, formats
def test_function_tools_round_trip_through_previous_response_id(start_gateway, engine_idle):
    weather = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                              "required": ["city"], "additionalProperties": False}}
    config = EngineConfig(tool_parser="hermes", chat_template=TEMPLATE)
    with start_gateway(backend_config=config) as (url, _), sdk(url) as client:
        r = client.responses.create(input="What is the weather in Paris?", tools=[weather],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    **{**GREEDY, "max_output_tokens": 60})
        (call,) = [item for item in r.output if item.type == "function_call"]
        assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id
        assert set(json.loads(call.arguments)) == {"city"}
        answer = client.responses.create(
            previous_response_id=r.id, tools=[weather], tool_choice="none",
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}], **GREEDY)
        assert answer.status in ("completed", "incomplete") and answer.output_text
        assert answer.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens


def test_text_format_json_schema_parses_into_a_model(client, engine_idle):
    class City(BaseModel):  # bounded fields: greedy SmolLM2 writes digits for ever into an unbounded integer
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    r = client.responses.parse(input="Describe Paris as JSON.", text_format=City, model=MODEL, temperature=0,
                               max_output_tokens=100)
    assert isinstance(r.output_parsed, City)


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "frobnicate": True}, "frobnicate"),
    ({"input": "x", "background": True, "stream": True}, "stream"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"model": "no-such-model", "input": "x"}, "model"),
])
def test_bad_requests_are_400s_naming_the_field(served, body, param, engine_idle):
    r = httpx.post(f"{served[0]}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param or param in error["message"]


def test_unknown_ids_are_404s_in_the_openai_shape(served):
    for method, path in (("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
                         ("POST", "/v1/responses/resp_nope/cancel")):
        r = httpx.request(method, f"{served[0]}{path}", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["message"] == "Response with id 'resp_nope' not found."
    r = httpx.post(f"{served[0]}/v1/responses", json={**GREEDY, "input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


# ------------------------------------------------------------------------- routing and Redis
def _two_replicas(native_engine, **settings):
    """One model on two deployments (both on the shared engine) routed round robin."""
    deployments = [Deployment(name=f"native-{i}", backend=NativeBackend(MODEL, engine=native_engine),
                              limiter=ConcurrencyLimiter(8, 64)) for i in range(2)]
    gateway = Gateway(Settings(**settings), [ModelGroup(MODEL, deployments, routing=RoundRobinConfig())])
    return gateway, serve_app(create_app(gateway))


def _decisions(gateway, reason):
    return {d: gateway.metrics.registry.get_sample_value(
        "burstgate:routing_decisions_total", {"model": MODEL, "backend": d, "reason": reason}) or 0
        for d in ("native-0", "native-1")}


def test_a_conversation_stays_on_the_replica_that_holds_it(native_engine, engine_idle):
    gateway, server = _two_replicas(native_engine)
    with server as url, sdk(url) as client:
        r = client.responses.create(input="Hi, I am Ada.", **GREEDY)
        for question in ("Who am I?", "Say it again.", "Thanks."):
            r = client.responses.create(input=question, previous_response_id=r.id, **GREEDY)
        first = _decisions(gateway, "round_robin")
        held = _decisions(gateway, "conversation")
    assert sum(first.values()) == 1 and sum(held.values()) == 3
    assert held[max(first, key=first.get)] == 3  # every later turn where the first was answered


@contextlib.contextmanager
def _replicas_sharing_redis(native_engine):
    """Two gateway replicas (each two deployments on the shared engine) storing responses in one real Redis: their
    clients, and the second gateway."""
    with redis_server() as redis_url:
        _, server_one = _two_replicas(native_engine, responses={"redis_url": redis_url})
        two, server_two = _two_replicas(native_engine, responses={"redis_url": redis_url})
        with server_one as url_one, server_two as url_two, sdk(url_one) as a, sdk(url_two) as b:
            yield a, b, two


def _long_background(client) -> str:
    """A background response that generates for a long while; its id, once it runs."""
    r = client.responses.create(input="Count to a thousand.", background=True, model=MODEL, temperature=0,
                                max_output_tokens=900, extra_body={"ignore_eos": True})
    _wait(client, r.id, ("in_progress",))
    return r.id


def _until_idle(engine, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_gateway_replicas_share_stored_responses_through_redis(native_engine, engine_idle):
    with _replicas_sharing_redis(native_engine) as (a, b, two):
        first = a.responses.create(input="My name is Ada.", **GREEDY)
        assert b.responses.retrieve(first.id).output_text == first.output_text
        second = b.responses.create(input="What is my name?", previous_response_id=first.id, **GREEDY)
        assert a.responses.retrieve(second.id).previous_response_id == first.id
        assert sum(_decisions(two, "conversation").values()) == 1  # routed by the stored deployment


def test_a_background_response_is_stopped_by_a_cancel_sent_to_another_replica(native_engine, engine_idle):
    """Replica two cancels what replica one runs: one stops generating and stores what it had as cancelled."""
    with _replicas_sharing_redis(native_engine) as (a, b, _):
        rid = _long_background(a)
        time.sleep(0.5)  # some tokens generated
        cancelled = b.responses.cancel(rid)
        assert cancelled.status == "cancelled"
        assert cancelled.output_text  # what replica one had generated, stored by replica one
        assert a.responses.retrieve(rid).status == "cancelled"
        _until_idle(native_engine, "the response still runs on replica one")
        assert len(a.responses.retrieve(rid).output_text) == len(cancelled.output_text)


def test_deleting_through_another_replica_stops_the_response_there(native_engine, engine_idle):
    with _replicas_sharing_redis(native_engine) as (a, b, _):
        rid = _long_background(a)
        b.responses.delete(rid)
        _until_idle(native_engine, "the deleted response still runs on replica one")
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(rid)
