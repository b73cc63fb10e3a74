"""LangChain's OpenAI chat model (langchain-openai) against the embedded default's settings, through chat
completions and through the Responses API: ``bind_tools`` with each tool choice and ``with_structured_output``
with each of its three methods, as an application developer writes them."""

from __future__ import annotations

import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from backends.native.config import EngineConfig
from gateway.config import embedded_default
from tests.conftest import MODEL


class GetWeather(BaseModel):
    """Current weather of a city."""

    city: str = Field(max_length=20)


class City(BaseModel):  # bounded fields: greedy SmolLM2 writes digits for ever into an unbounded integer
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def served(start_gateway):
    default = embedded_default()
    with start_gateway(backend_config=EngineConfig(tool_parser=default.tool_parser,
                                                   chat_template=default.chat_template)) as (url, _):
        yield url


@pytest.fixture(params=[False, True], ids=["chat", "responses"])
def llm(served, request):
    return ChatOpenAI(model=MODEL, base_url=f"{served}/v1", api_key="unused", temperature=0, max_tokens=80,
                      max_retries=0, timeout=300, use_responses_api=request.param)


def test_bind_tools_auto_is_answered(llm, engine_idle):
    message = llm.bind_tools([GetWeather], tool_choice="auto").invoke("What is the weather in Paris?")
    assert message.content or message.tool_calls


@pytest.mark.parametrize("choice", ["any", "GetWeather"])
def test_bind_tools_forced_calls_the_tool(llm, choice, engine_idle):
    message = llm.bind_tools([GetWeather], tool_choice=choice).invoke("What is the weather in Paris?")
    (call,) = message.tool_calls[:1]
    assert call["name"] == "GetWeather" and GetWeather(**call["args"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_into_a_model(llm, method, engine_idle):
    city = llm.with_structured_output(City, method=method).invoke("Describe Paris.")
    assert isinstance(city, City)


def test_structured_output_json_mode(llm, engine_idle):
    # an unconstrained object: a prompt the small model copies keeps it short enough to close
    answer = llm.with_structured_output(method="json_mode").invoke('Repeat this JSON object: {"city": "Paris"}')
    assert isinstance(answer, dict)
