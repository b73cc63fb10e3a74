"""``/v1/responses`` through an ``openai`` deployment: relayed to the server's own ``/v1/responses`` where it has one
(here another burstgate; vLLM in tests/peers/test_vllm_responses.py), served over its chat completions where it has
not. Relayed or not, the client gets the same answer: the gateway keeps the conversation, so the server gets each
turn whole (the history in ``input``), stores nothing, and a client that leaves or cancels stops its work."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import openai
import pytest

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.config import OpenAIDeployment, Settings
from gateway.deployments import Deployment
from gateway.limits import ConcurrencyLimiter
from gateway.routing import ModelGroup
from gateway.service import Gateway
from loadtest.mock_server import create_mock_app
from tests.conftest import MODEL
from tests.servers import serve_app

TEMPLATE = str(Path(__file__).resolve().parents[3] / "configs" / "chat_templates" / "chatml_tools.jinja")
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


class Recorder:
    """An upstream's ASGI app, keeping the method, path and JSON body of every request sent to it."""

    def __init__(self, app) -> None:
        self.app = app
        self.seen: list[tuple[str, str, dict | None]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        messages, body = [], b""
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append((scope["method"], scope["path"], json.loads(body) if body else None))

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    def posts(self, path: str) -> list[dict]:
        return [body for method, p, body in self.seen if method == "POST" and p == path]


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)


@contextlib.contextmanager
def gateway_in_front(upstream: str, responses_api: str):
    """A gateway whose one deployment is the ``openai`` kind at ``upstream``; its SDK client."""
    deployment = OpenAIDeployment(kind="openai", name="up", url=f"{upstream}/v1", responses_api=responses_api)
    settings = Settings(models=[{"name": MODEL, "deployments": [deployment]}])
    with serve_app(create_app(Gateway.from_settings(settings))) as url, sdk(url) as client:
        yield client


@pytest.fixture(scope="module")
def upstream(native_engine):
    """A burstgate serving the native engine (tools read with hermes), recorded."""
    backend = NativeBackend(MODEL, config=EngineConfig(tool_parser="hermes", chat_template=TEMPLATE),
                            engine=native_engine)
    group = ModelGroup(MODEL, [Deployment(name="native-0", backend=backend, limiter=ConcurrencyLimiter(64, 256))])
    recorder = Recorder(create_app(Gateway(Settings(), [group])))
    with serve_app(recorder) as url:
        yield url, recorder


@pytest.fixture(scope="module")
def clients(upstream):
    """(relayed, over chat): gateways in front of the same upstream, one relaying turns, one serving them over chat."""
    with gateway_in_front(upstream[0], "auto") as relayed, gateway_in_front(upstream[0], "chat") as over_chat:
        yield relayed, over_chat


@pytest.fixture
def recorder(upstream):
    upstream[1].seen.clear()
    return upstream[1]


def _answer(client, **body):
    r = client.responses.create(**{**GREEDY, **body})
    return r, (r.status, r.output_text, r.usage.input_tokens, r.usage.output_tokens)


def test_a_conversation_is_relayed_turn_by_turn_and_answers_as_over_chat(clients, recorder, engine_idle):
    relayed, over_chat = clients
    outcomes = []
    for client in (relayed, over_chat):
        first, one = _answer(client, input="My name is Ada. Say hello.", instructions="Be brief.")
        second, two = _answer(client, input="What is my name?", previous_response_id=first.id)
        assert client.responses.retrieve(second.id).previous_response_id == first.id  # stored by the gateway
        outcomes.append((one, two))
    assert outcomes[0] == outcomes[1]
    turns = recorder.posts("/v1/responses")
    assert len(turns) == 2 and len(recorder.posts("/v1/chat/completions")) == 2  # the relay's, then over chat's
    assert all(t["store"] is False and t["stream"] is True and "previous_response_id" not in t for t in turns)
    assert turns[0]["instructions"] == "Be brief."
    assert turns[1]["input"] == [  # the history before the input; instructions are not carried (OpenAI's rule)
        {"type": "message", "role": "user", "content": "My name is Ada. Say hello."},
        {"type": "message", "role": "assistant", "content": outcomes[0][0][1]},
        {"type": "message", "role": "user", "content": "What is my name?"}]


def test_a_relayed_stream_folds_to_the_same_response_through_the_sdks_helper(clients, recorder, engine_idle):
    relayed, over_chat = clients
    whole = over_chat.responses.create(input="Name three colours.", **GREEDY)
    with relayed.responses.stream(input="Name three colours.", **GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert (final.output_text, final.usage.output_tokens) == (whole.output_text, whole.usage.output_tokens)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert len(recorder.posts("/v1/responses")) == 1


def test_cut_by_max_output_tokens_is_incomplete_when_relayed(clients, recorder, engine_idle):
    r = clients[0].responses.create(input="Tell me a long story.", **{**GREEDY, "max_output_tokens": 3})
    assert (r.status, r.incomplete_details.reason, r.usage.output_tokens) == ("incomplete", "max_output_tokens", 3)
    assert recorder.posts("/v1/responses")[0]["max_output_tokens"] == 3


def test_function_calls_are_relayed_and_their_outputs_continue_the_conversation(clients, recorder, engine_idle):
    relayed, _ = clients
    r = relayed.responses.create(input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 **{**GREEDY, "max_output_tokens": 60})
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    answer = relayed.responses.create(
        previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}], **GREEDY)
    assert answer.output_text
    history = recorder.posts("/v1/responses")[1]["input"]
    assert history[1:] == [{"type": "function_call", "call_id": call.call_id, "name": "get_weather",
                            "arguments": call.arguments},
                           {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]


def _until_idle(engine, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


LONG = {"input": "Count to a thousand.", "model": MODEL, "temperature": 0, "max_output_tokens": 900,
        "extra_body": {"ignore_eos": True}}


def test_a_client_leaving_a_relayed_stream_stops_the_upstream_generation(clients, engine_idle):
    with clients[0].responses.stream(**LONG) as stream:
        deltas = 0
        for event in stream:
            deltas += event.type == "response.output_text.delta"
            if deltas == 3:
                break
    _until_idle(engine_idle, "the upstream kept generating after the client left")


def test_cancelling_a_relayed_background_response_stops_the_upstream_generation(clients, engine_idle):
    relayed, _ = clients
    r = relayed.responses.create(background=True, **LONG)
    deadline = time.monotonic() + 60
    while relayed.responses.retrieve(r.id).status == "queued" or not engine_idle.has_unfinished():
        assert time.monotonic() < deadline, "the background response never started upstream"
        time.sleep(0.05)
    assert relayed.responses.cancel(r.id).status == "cancelled"
    _until_idle(engine_idle, "the upstream kept generating after the cancel")


def test_a_server_without_the_route_is_asked_once_then_served_over_chat():
    mock = Recorder(create_mock_app(MODEL))
    with serve_app(mock) as upstream, gateway_in_front(upstream, "auto") as client:
        for _ in range(2):
            assert client.responses.create(input="Hi", model=MODEL, max_output_tokens=4).status == "incomplete"
    assert [(m, p) for m, p, _ in mock.seen if p == "/v1/responses"] == [("GET", "/v1/responses")]
    assert len(mock.posts("/v1/chat/completions")) == 2


def test_relaying_to_a_server_without_the_route_fails_in_the_openai_shape():
    with serve_app(create_mock_app(MODEL)) as upstream, gateway_in_front(upstream, "relay") as client:
        with pytest.raises(openai.APIStatusError) as failure:
            client.responses.create(input="Hi", model=MODEL, max_output_tokens=4)
    assert failure.value.status_code == 502 and "404" in failure.value.message
