"""Constrained decoding and tools, without a swarm: grammars over SmolLM2's real tokenizer drive random logits to
valid output, unsupported schemas are refused by name, tool calls are parsed and conversations rendered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer

from swarmlm.api.grammar import (
    MAX_GRAMMAR_BYTES,
    GrammarError,
    Grammars,
    closed,
    json_object_grammar,
    json_schema_grammar,
    response_format_grammar,
)
from swarmlm.api.schemas import ApiError, ChatRequest, parse_body
from swarmlm.api.tools import (
    GENERIC,
    HERMES,
    Function,
    forced_grammar,
    output_format,
    parse_calls,
    plan_tools,
    template_renders_tools,
)

EOS = 2  # SmolLM2's <|im_end|>


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    active: bool


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]}, "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"], "additionalProperties": False,
}  # fmt: skip
WEATHER = Function("get_weather", "The weather in a city", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"], "additionalProperties": False,
})  # fmt: skip
HERMES_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.tool_calls %}<tool_call>{{ m.tool_calls | tojson }}"
    "</tool_call>{% endif %}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def grammars(smollm_dir: Path) -> Grammars:
    return Grammars(AutoTokenizer.from_pretrained(smollm_dir), frozenset([EOS]), 49152)


def decode_randomly(grammars: Grammars, grammar: str, rows: int, seed: int, limit: int = 400) -> list[str]:
    """Each row's text when random logits are sampled through the grammar's mask (as a random model would)."""
    guide = grammars.guide(grammar, rows)
    generator = torch.Generator().manual_seed(seed)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for _ in range(limit):
        logits = torch.randn(rows, 49152, generator=generator) * 3
        probs = torch.softmax(guide.masked(logits), dim=-1)
        chosen = torch.multinomial(probs, 1, generator=generator)[:, 0]
        for row in range(rows):
            token = int(chosen[row])
            if done[row]:
                continue
            if token == EOS:
                done[row] = True
                continue
            tokens[row].append(token)
            done[row] = guide.ended(row, token)
        if all(done):
            break
    assert all(done), "a grammar of bounded output did not end"
    return [grammars.hf_tokenizer.decode(row) for row in tokens]


def test_random_logits_through_a_schemas_mask_give_valid_objects(grammars: Grammars) -> None:
    for text in decode_randomly(grammars, json_schema_grammar(PERSON), rows=3, seed=1):
        Person.model_validate_json(text)  # raises when invalid


def test_the_masked_logits_allow_only_the_grammars_tokens(grammars: Grammars) -> None:
    guide = grammars.guide(json_object_grammar(), 2)
    masked = guide.masked(torch.zeros(2, 49152))
    allowed = torch.isfinite(masked)
    brace = grammars.hf_tokenizer.convert_tokens_to_ids("{")
    assert allowed[:, brace].all() and allowed.sum(-1).tolist() == [allowed[0].sum().item()] * 2
    assert not allowed[:, EOS].any() and allowed[0].sum() < 49152 // 10  # an object must begin with "{"


def test_json_object_grammar_gives_an_object(grammars: Grammars) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["a"], "additionalProperties": False}  # fmt: skip
    (text,) = decode_randomly(grammars, json_schema_grammar(schema), rows=1, seed=3)
    assert isinstance(json.loads(text)["a"], int)


def test_unsupported_schema_features_are_refused_by_name(grammars: Grammars) -> None:
    schema = {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    with pytest.raises(GrammarError, match='"if", "then"'):
        grammars.check(json_schema_grammar(schema))
    with pytest.raises(GrammarError, match="Invalid type"):
        grammars.check(json_schema_grammar({"type": "frob"}))
    huge = {"enum": ["x" * 100] * (MAX_GRAMMAR_BYTES // 100)}
    with pytest.raises(GrammarError, match="larger than"):
        json_schema_grammar(huge)


def test_forced_tool_calls_follow_the_functions_schema_in_both_formats(grammars: Grammars) -> None:
    names = frozenset(["get_weather"])
    for fmt in (HERMES, GENERIC):
        for text in decode_randomly(grammars, forced_grammar(fmt, [WEATHER], parallel=False), rows=2, seed=5):
            content, calls = parse_calls(fmt, text, names)
            assert content is None and len(calls) == 1 and calls[0].name == "get_weather"
            arguments = json.loads(calls[0].arguments)
            assert set(arguments) == {"city", "celsius"} and isinstance(arguments["celsius"], bool)


def test_tool_calls_are_parsed_only_when_every_call_is_well_formed() -> None:
    names = frozenset(["f", "g"])
    content, calls = parse_calls(HERMES, 'Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
                                 '<tool_call>{"name": "g", "arguments": "{}"}</tool_call>', names)  # fmt: skip
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}'), ("g", "{}")]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert parse_calls(HERMES, '<tool_call>{"name": "h", "arguments": {}}</tool_call>', names)[1] == ()
    assert parse_calls(HERMES, "<tool_call>{not json</tool_call>", names)[1] == ()
    text = '{"tool_calls": [{"name": "g", "arguments": {"y": "z"}}]}'
    assert [(c.name, json.loads(c.arguments)) for c in parse_calls(GENERIC, text, names)[1]] == [("g", {"y": "z"})]
    assert parse_calls(GENERIC, '{"name": "f", "parameters": {}}', names)[1][0].name == "f"  # Llama's own shape
    assert parse_calls(GENERIC, "The weather is fine.", names) == ("The weather is fine.", ())
    assert parse_calls(GENERIC, '{"tool_calls": []}', names)[1] == ()


def test_templates_that_render_tools_are_told_apart() -> None:
    assert template_renders_tools(HERMES_TEMPLATE) and output_format(HERMES_TEMPLATE) == HERMES
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not template_renders_tools(plain) and output_format(plain) == GENERIC
    assert not template_renders_tools(None) and not template_renders_tools("{% for %}")


def chat(**fields: Any) -> ChatRequest:
    return parse_body(json.dumps({"model": "m", **fields}).encode(), ChatRequest)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
FOLLOW_UP = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
]


def test_a_template_without_tools_gets_them_in_a_system_message_and_results_as_a_user_turn() -> None:
    plan = plan_tools(chat(messages=FOLLOW_UP, tools=TOOLS, tool_choice="required"), "{{ messages }}")
    assert plan.fmt == GENERIC and plan.template_tools is None and plan.grammar is not None
    roles = [m["role"] for m in plan.messages]
    assert roles == ["system", "user", "assistant", "user"] and "get_weather" in plan.messages[0]["content"]
    assert json.loads(plan.messages[2]["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    }
    assert "-3 C" in plan.messages[3]["content"] and "call_1" in plan.messages[3]["content"]
    assert plan_tools(chat(messages=FOLLOW_UP, tools=TOOLS, tool_choice="none"), "").parsed == frozenset()
    auto = plan_tools(chat(messages=FOLLOW_UP, tools=TOOLS), "")
    assert auto.grammar is None and auto.parsed == {"get_weather"}


def test_a_template_with_tools_renders_them_itself() -> None:
    plan = plan_tools(chat(messages=FOLLOW_UP, tools=TOOLS, tool_choice="auto"), HERMES_TEMPLATE)
    assert plan.fmt == HERMES and plan.template_tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}
    ]
    assert plan.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert plan.messages[2] == {"role": "tool", "content": "-3 C", "tool_call_id": "call_1", "name": "get_weather"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ],
)
def test_malformed_tool_and_format_fields_are_400s_naming_them(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        chat(**{"messages": [{"role": "user", "content": "hi"}], **fields})
    assert caught.value.status == 400 and (caught.value.param or "").startswith(param)


def test_response_formats_map_to_grammars() -> None:
    body = chat(messages=[{"role": "user", "content": "hi"}], response_format={"type": "text"})
    assert response_format_grammar(body.response_format) is None and response_format_grammar(None) is None
    schema_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    body = chat(messages=[{"role": "user", "content": "hi"}], response_format=schema_format)
    assert response_format_grammar(body.response_format) == json_schema_grammar(PERSON)


def test_objects_listing_their_properties_are_closed_to_others() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
              "c": {"type": "array", "items": {"properties": {"d": {}}, "additionalProperties": True}}},
              "$defs": {"E": {"properties": {"enum": {"enum": [{"properties": 1}]}}}}}  # fmt: skip
    shut = closed(schema)
    assert shut["additionalProperties"] is False and shut["properties"]["a"]["additionalProperties"] is False
    assert shut["properties"]["c"]["items"]["additionalProperties"] is True  # said: kept
    assert shut["$defs"]["E"]["additionalProperties"] is False
    assert shut["$defs"]["E"]["properties"]["enum"] == {"enum": [{"properties": 1}]}  # values are not schemas
    assert closed({"type": "object"}) == {"type": "object"}  # no properties listed: any object
