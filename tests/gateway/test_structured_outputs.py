"""Structured outputs through the gateway with the real openai SDK: ``client.chat.completions.parse`` with
Pydantic models (OpenAI's json_schema response_format), vLLM's ``structured_outputs`` and its older
``guided_*`` fields, streaming, and a 400 naming the field for every constraint that cannot be compiled."""

from __future__ import annotations

import asyncio
import enum
import json
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import MODEL

Short = Field(max_length=16)
Word = Annotated[str, Field(max_length=12)]


class Colour(enum.StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Address(BaseModel):
    street: str = Short
    city: str = Short


class Person(BaseModel):
    name: str = Short
    age: int = Field(ge=0, le=120)


class Flag(BaseModel):
    enabled: bool


class Rating(BaseModel):
    stars: int = Field(ge=1, le=5)


class Temperature(BaseModel):
    celsius: float = Field(ge=-50, le=60)


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    name: str = Short


class Paint(BaseModel):
    colour: Colour


class Tags(BaseModel):
    tags: list[Word] = Field(max_length=3)


class Scores(BaseModel):
    scores: list[int] = Field(max_length=4)


class Segment(BaseModel):
    start: Point
    end: Point


class Contact(BaseModel):
    person: Person
    address: Address


class MaybeNickname(BaseModel):
    name: str = Short
    nickname: str | None = Field(max_length=12)


class Inventory(BaseModel):
    item: str = Short
    count: int = Field(ge=0, le=1000)
    in_stock: bool


class Book(BaseModel):
    title: str = Field(max_length=24)
    year: int = Field(ge=1450, le=2030)


class Library(BaseModel):
    books: list[Book] = Field(max_length=2)


class Weather(BaseModel):
    city: str = Short
    sky: Literal["sunny", "cloudy", "rainy"]
    temperature: int = Field(ge=-50, le=60)


class Answer(BaseModel):
    answer: Literal["yes", "no"]


class Priority(BaseModel):
    level: Literal["low", "medium", "high"]
    reason: str = Field(max_length=24)


class Polygon(BaseModel):
    points: list[Point] = Field(max_length=3)


class Team(BaseModel):
    name: str = Short
    members: list[Person] = Field(max_length=2)


class Price(BaseModel):
    amount: float = Field(ge=0, le=1000)
    currency: Literal["EUR", "USD", "GBP"]


class Event(BaseModel):
    title: str = Short
    day: int = Field(ge=1, le=31)
    month: int = Field(ge=1, le=12)


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confidence: float = Field(ge=0, le=1)


class Coordinates(BaseModel):
    lat: float = Field(ge=-90, le=90)
    lon: float = Field(ge=-180, le=180)


class Recipe(BaseModel):
    dish: str = Short
    ingredients: list[Word] = Field(max_length=3)
    minutes: int = Field(ge=1, le=300)


class Settings(BaseModel):
    theme: Colour
    volume: int = Field(ge=0, le=10)
    muted: bool


class Profile(BaseModel):
    person: Person
    pets: list[Pet] = Field(max_length=2)


class Matrix(BaseModel):
    rows: list[list[int]] = Field(max_length=2)  # inner lists unbounded


class Optional2(BaseModel):
    first: int | None = Field(ge=0, le=9)
    second: bool | None


class Nested3(BaseModel):
    segment: Segment
    label: str = Short


MODELS: list[tuple[type[BaseModel], str]] = [
    (Point, "Give a point."), (Address, "Give an address."), (Person, "Describe a person."),
    (Flag, "Is it enabled?"), (Rating, "Rate a film."), (Temperature, "What is the temperature?"),
    (Pet, "Describe a pet."), (Paint, "Pick a paint colour."), (Tags, "Tag a photo of a beach."),
    (Scores, "Give some test scores."), (Segment, "Give a line segment."), (Contact, "Give a contact."),
    (MaybeNickname, "Name someone."), (Inventory, "Describe a stock item."), (Book, "Name a book."),
    (Library, "List books."), (Weather, "Report the weather in Paris."), (Answer, "Is water wet?"),
    (Priority, "Prioritise fixing a leak."), (Polygon, "Give a triangle."), (Team, "Describe a team."),
    (Price, "Price a coffee."), (Event, "Plan a party."), (Sentiment, "Classify: I love it."),
    (Coordinates, "Where is London?"), (Recipe, "Give a quick recipe."), (Settings, "Suggest app settings."),
    (Profile, "Describe a pet owner."), (Matrix, "Give a small matrix."), (Optional2, "Fill in the form."),
    (Nested3, "Label a segment."),
]


@pytest.fixture(scope="module")
def client(gateway_url):
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def test_sdk_parse_returns_valid_objects_for_many_schemas(gateway_url, engine_idle):
    """The 135M model, free to put any whitespace between JSON tokens, sometimes emits newlines forever;
    vLLM's ``disable_any_whitespace`` (applied over ``response_format``, as vLLM does) keeps it compact."""
    assert len(MODELS) >= 30

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as c:
            return await asyncio.gather(*(c.chat.completions.parse(
                model=MODEL, messages=[{"role": "user", "content": question}], response_format=model,
                max_tokens=160, temperature=0, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
                for model, question in MODELS))

    for (model, _), completion in zip(MODELS, asyncio.run(main())):
        choice = completion.choices[0]
        assert isinstance(choice.message.parsed, model), (model.__name__, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())
        assert choice.finish_reason == "stop"


def test_streamed_structured_output_concatenates_to_valid_json(client):
    schema = Weather.model_json_schema()
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], max_tokens=80, temperature=0,
        stream=True, response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # token by token


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": "[A-Z][a-z]{2,8}"}}, lambda t: t[0].isupper() and t[1:].islower()),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}},
     lambda t: isinstance(json.loads(t)["n"], int)),
    ({"structured_outputs": {"grammar": 'root ::= ("up" | "down") " " [0-9]'}}, lambda t: t.split()[0] in ("up", "down")),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
    ({"guided_regex": "[0-9]{4}"}, lambda t: t.isdigit() and len(t) == 4),
    ({"guided_choice": ["tea", "coffee"]}, lambda t: t in ("tea", "coffee")),
    ({"guided_grammar": 'root ::= "x" | "y"'}, lambda t: t in ("x", "y")),
])
def test_vllm_structured_outputs_and_guided_fields(client, extra, check):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go."}], max_tokens=40,
                                       temperature=0, extra_body=extra)
    assert check(r.choices[0].message.content), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_json_object_on_completions(client):
    r = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:", max_tokens=12, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.lstrip().startswith("{")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}}}}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_regex": "[0-9]", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_bad_constraints_get_a_400_naming_the_field(gateway_url, engine_idle, body, param):
    r = httpx.post(f"{gateway_url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
