"""Structured output and tools through `swarmlm api` over a real swarm of the bundled SmolLM2, driven by the clients
people use: the openai SDK's `.parse()`, LangChain's `with_structured_output` and `bind_tools`, streamed tool calls
and a `role: tool` follow-up turn. SmolLM2's template knows no tools, so the API's generic JSON format is in use."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import running_swarm
from tests.integration.http_process import api_process

NAME = "smollm2-135m-instruct"


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=24, description="the city's name")
    celsius: bool


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                "parameters": GetWeather.model_json_schema()}}  # fmt: skip


@pytest.fixture(scope="module")
def swarm(smollm_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(smollm_dir, [(0, 30)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def api_url(smollm_dir: Path, swarm: LocalSwarm) -> Iterator[str]:
    with api_process(smollm_dir, swarm.initial_peers, NAME) as url:
        yield url


@pytest.fixture(scope="module")
def client(api_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat_model(api_url: str) -> ChatOpenAI:
    return ChatOpenAI(model=NAME, base_url=f"{api_url}/v1", api_key="unused", temperature=0, max_tokens=80,
                      max_retries=0, timeout=120)  # fmt: skip


def test_the_sdks_parse_gives_a_valid_object(client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "Describe Paris as JSON."}]
    reply = client.chat.completions.parse(
        model=NAME, messages=question, response_format=City, max_tokens=60, temperature=0
    )
    assert isinstance(reply.choices[0].message.parsed, City) and reply.choices[0].finish_reason == "stop"


def test_langchain_structured_output_gives_a_valid_object(api_url: str) -> None:
    city = chat_model(api_url).with_structured_output(City, method="json_schema").invoke("Describe Rome.")
    assert isinstance(city, City)


def test_json_object_choices_are_each_valid_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "A JSON object about cats."}], stream=True, n=2,
        temperature=1.0, seed=7, max_tokens=80, response_format={"type": "json_object"},
        extra_body={"top_k": 0},
    )  # fmt: skip
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert "stop" in reasons and texts[0] != texts[1]
    for text, reason in zip(texts, reasons, strict=True):
        assert reason == "length" or isinstance(json.loads(text), dict), text  # each choice its own matcher


def test_langchain_bind_tools_with_a_forced_tool_gives_a_valid_call(api_url: str) -> None:
    model = chat_model(api_url).bind_tools([GetWeather], tool_choice="GetWeather")
    message = model.invoke("What is the weather in Oslo?")
    assert isinstance(message, AIMessage) and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call["name"] == "GetWeather" and call["id"]
    GetWeather.model_validate(call["args"])


def test_streamed_tool_calls_and_a_tool_result_turn(client: openai.OpenAI) -> None:
    question = {"role": "user", "content": "What is the weather in Oslo?"}
    stream = client.chat.completions.create(model=NAME, messages=[question], tools=[WEATHER_TOOL], stream=True,
                                            tool_choice="required", max_tokens=60, temperature=0)  # fmt: skip
    calls: dict[int, dict[str, Any]] = {}
    reasons = []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += part.id or ""
            call["name"] += part.function.name or "" if part.function else ""
            call["arguments"] += part.function.arguments or "" if part.function else ""
    assert reasons == ["tool_calls"] and len(calls) >= 1 and calls[0]["name"] == "get_weather"
    GetWeather.model_validate_json(calls[0]["arguments"])
    sent = {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0]["id"], "type": "function", "function": {"name": "get_weather",
                                                                "arguments": calls[0]["arguments"]}}]}  # fmt: skip
    result = {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temperature": -3, "sky": "snow"}'}
    reply = client.chat.completions.create(model=NAME, messages=[question, sent, result], tools=[WEATHER_TOOL],
                                           tool_choice="none", max_tokens=16, temperature=0)  # fmt: skip
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_named_tool_choice_whole_reply_has_openais_shape(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Weather in Lima?"}], tools=[WEATHER_TOOL], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
        temperature=0,
    )  # fmt: skip
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert len(message.tool_calls or []) == 1 and message.tool_calls[0].type == "function"
    assert message.tool_calls[0].id.startswith("call_") and message.tool_calls[0].function.name == "get_weather"
    GetWeather.model_validate_json(message.tool_calls[0].function.arguments)


def test_a_schema_with_unsupported_features_is_a_400_naming_them(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]}, "then": {}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
        )  # fmt: skip
    assert '"if", "then"' in caught.value.message
    assert caught.value.body["param"] == "response_format.json_schema.schema"
    assert client.models.list().data[0].id == NAME  # the server goes on
