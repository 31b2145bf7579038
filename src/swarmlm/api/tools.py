"""Tools (function calling): the conversation and tools as the model's chat template takes them, the grammar of a
forced tool call, the calls parsed from a model's output, and OpenAI's `tool_calls` shapes.

Two output formats. A template that renders `tools` and writes `<tool_call>` (Hermes, Qwen) gets its own format:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call. Any other template (SmolLM2's
ignores `tools`) gets a generic JSON format that the API explains in a system message: the answer is
`{"tool_calls": [{"name": ..., "arguments": {...}}]}`, and earlier calls and results are written into the
conversation as text, so that templates which know nothing of tools (or refuse a `tool` role) still render it.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
from jinja2 import meta

from swarmlm.api.engine import Delta, TokenLogprob
from swarmlm.api.grammar import embedded_json, json_schema_grammar, lark_grammar
from swarmlm.api.schemas import ChatRequest, Message, NamedToolChoice, Tool

# calls in one forced answer at most when parallel_tool_calls is on (a small model may otherwise repeat calls until
# max_tokens)
MAX_PARALLEL_CALLS = 8
HERMES = "hermes"
GENERIC = "json"
HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# a function's arguments when it declares no parameters: an empty object, as OpenAI's
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's clients parse it themselves)

    def shape(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's shape of the call (with `index` inside a streamed delta)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolDelta(Delta):
    """A choice's last delta when its answer was tool calls (finish_reason "tool_calls")."""

    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any] | None

    def for_template(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"name": self.name, "parameters": self.parameters or NO_PARAMETERS}
        if self.description:
            spec["description"] = self.description
        return {"type": "function", "function": spec}


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools go in and come out."""

    messages: list[dict[str, Any]]  # the conversation as the chat template takes it
    template_tools: list[dict[str, Any]] | None  # apply_chat_template's tools= (None: the template ignores tools)
    grammar: str | None  # the grammar of a forced call (tool_choice required or a named function)
    fmt: str = GENERIC  # HERMES or GENERIC
    parsed: frozenset[str] = field(default_factory=frozenset)  # functions whose calls are read from the answer


def template_renders_tools(template: Any) -> bool:
    """Whether a chat template (jinja source) reads the `tools` variable."""
    if not isinstance(template, str):
        return False
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False


def output_format(template: Any) -> str:
    if template_renders_tools(template) and "<tool_call>" in template:
        return HERMES
    return GENERIC


def call_schema(functions: Sequence[Function]) -> dict[str, Any]:
    """The JSON schema of one call of any of `functions`: {"name": ..., "arguments": {...}}."""
    options = [
        {"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters or NO_PARAMETERS},
         "required": ["name", "arguments"], "additionalProperties": False}
        for f in functions
    ]  # fmt: skip
    return options[0] if len(options) == 1 else {"anyOf": options}


def forced_grammar(fmt: str, functions: Sequence[Function], parallel: bool) -> str:
    """The grammar of an answer that is only tool calls (one, or up to MAX_PARALLEL_CALLS when parallel)."""
    most = MAX_PARALLEL_CALLS if parallel else 1
    if fmt == HERMES:
        more = f' ("\\n" call){{0,{most - 1}}}' if most > 1 else ""
        call = f'call: "<tool_call>\\n" {embedded_json(call_schema(functions))} "\\n</tool_call>"'
        return lark_grammar(f"start: call{more}\n{call}\n")
    calls = {"type": "array", "items": call_schema(functions), "minItems": 1, "maxItems": most}
    schema = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
              "additionalProperties": False}  # fmt: skip
    return json_schema_grammar(schema)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(item: Any, names: frozenset[str]) -> ToolCall | None:
    """A call from its parsed JSON ({"name", "arguments"}), or None when it is not a call of a known function."""
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), item["name"], json.dumps(arguments, ensure_ascii=False))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_calls(fmt: str, text: str, names: frozenset[str]) -> tuple[str | None, tuple[ToolCall, ...]]:
    """(content, calls) of an answer: calls only when every call in it parses and names a known function (else the
    whole text is content, as the model wrote it)."""
    if fmt == HERMES:
        blocks = HERMES_BLOCK.findall(text)
        calls = [_call(_json(block), names) for block in blocks]
        if not blocks or any(call is None for call in calls):
            return text, ()
        content = text[: text.index("<tool_call>")].strip()
        return content or None, tuple(call for call in calls if call is not None)
    answer = _json(text.strip())
    items = answer.get("tool_calls") if isinstance(answer, dict) and "tool_calls" in answer else [answer]
    if not isinstance(items, list) or not items:
        return text, ()
    calls = [_call(item, names) for item in items]
    if any(call is None for call in calls):
        return text, ()
    return None, tuple(call for call in calls if call is not None)


async def with_tool_calls(deltas: AsyncGenerator[Delta], plan: ToolPlan, n: int) -> AsyncGenerator[Delta]:
    """The choices' deltas with their answers read as tool calls: each choice's text is held to its end (any text
    might turn out to be a call), then sent as content, or as calls (finish_reason "tool_calls")."""
    texts = [""] * n
    held: list[list[TokenLogprob]] = [[] for _ in range(n)]
    async with contextlib.aclosing(deltas):  # closing this closes the generation's (which stops it) at once
        async for delta in deltas:
            texts[delta.index] += delta.text
            held[delta.index] += delta.logprobs
            if delta.finish_reason is not None:
                yield _answer(delta, texts[delta.index], tuple(held[delta.index]), plan)


def _answer(last: Delta, text: str, logprobs: tuple[TokenLogprob, ...], plan: ToolPlan) -> Delta:
    """A choice's whole answer as one delta: its tool calls, or its text."""
    content, calls = parse_calls(plan.fmt, text, plan.parsed)
    if calls and last.finish_reason == "stop":
        return ToolDelta(
            index=last.index, text=content or "", finish_reason="tool_calls", logprobs=logprobs, tool_calls=calls
        )
    return Delta(index=last.index, text=text, finish_reason=last.finish_reason, logprobs=logprobs)


def functions_of(tools: Sequence[Tool]) -> list[Function]:
    return [Function(t.function.name, t.function.description, t.function.parameters) for t in tools]


def plan_tools(body: ChatRequest, template: Any) -> ToolPlan:
    """How the request's tools go in (rendered by the template, or explained in a system message) and come out
    (a forced call's grammar; which functions' calls are read from the answer)."""
    functions = functions_of(body.tools or [])
    choice = body.tool_choice or ("auto" if functions else "none")
    fmt = output_format(template)
    offered = functions if choice != "none" else []
    if isinstance(choice, NamedToolChoice):
        offered = [f for f in functions if f.name == choice.function.name]
    parallel = body.parallel_tool_calls is not False
    if template_renders_tools(template):
        messages = [_template_message(m, body.messages) for m in body.messages]
        template_tools = [f.for_template() for f in functions] or None
    else:
        messages = _generic_conversation(body.messages, offered, parallel)
        template_tools = None
    grammar = forced_grammar(fmt, offered, parallel) if offered and choice != "auto" else None
    return ToolPlan(messages, template_tools, grammar, fmt, frozenset(f.name for f in offered))


def _names_by_call(messages: Sequence[Message]) -> dict[str, str]:
    """The function each earlier call id named (tool messages carry only the id)."""
    return {call.id: call.function.name for m in messages for call in m.tool_calls or []}


def _arguments(text: str) -> Any:
    parsed = _json(text)
    return parsed if isinstance(parsed, dict) else text


def _template_message(message: Message, messages: Sequence[Message]) -> dict[str, Any]:
    """A message as templates that render tools take it (Hugging Face's convention: arguments as objects)."""
    rendered: dict[str, Any] = dict(message.as_template_input())
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
            for call in message.tool_calls
        ]  # fmt: skip
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
        rendered["name"] = _names_by_call(messages).get(message.tool_call_id, "")
    return rendered


def generic_instructions(functions: Sequence[Function], parallel: bool) -> str:
    """The system text that offers `functions` to a model whose template knows no tools."""
    specs = json.dumps([f.for_template()["function"] for f in functions], ensure_ascii=False)
    how_many = "one or more calls" if parallel else "one call"
    return (
        f"You can call these functions (their arguments as JSON schemas):\n{specs}\n"
        f"To call functions ({how_many}), answer with only this JSON object: "
        '{"tool_calls": [{"name": "<function name>", "arguments": {<the arguments>}}]}'
    )


def _generic_conversation(
    messages: Sequence[Message], functions: Sequence[Function], parallel: bool
) -> list[dict[str, Any]]:
    """The conversation in plain system/user/assistant turns: the functions in the system message, earlier calls as
    the JSON the model would have written, their results as one user turn per run of tool messages."""
    rendered: list[dict[str, Any]] = []
    names = _names_by_call(messages)
    for message in messages:
        turn: dict[str, Any] = dict(message.as_template_input())
        if message.tool_calls:
            calls = [
                {"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in message.tool_calls
            ]
            turn["content"] = (turn["content"] + "\n" if turn["content"] else "") + json.dumps({"tool_calls": calls})
        if message.role == "tool":
            result = {"tool_call_id": message.tool_call_id, "name": names.get(message.tool_call_id or "", ""),
                      "content": turn["content"]}  # fmt: skip
            if rendered and rendered[-1].get("results") is not None:
                rendered[-1]["results"].append(result)
                continue
            turn = {"role": "user", "results": [result]}
        rendered.append(turn)
    for turn in rendered:
        if (results := turn.pop("results", None)) is not None:
            turn["content"] = "Function results:\n" + json.dumps(results, ensure_ascii=False)
    if functions:
        offer = generic_instructions(functions, parallel)
        if rendered[0]["role"] == "system":
            rendered[0]["content"] += "\n\n" + offer
        else:
            rendered.insert(0, {"role": "system", "content": offer})
    return rendered
