"""The OpenAI-compatible requests the API accepts, validated strictly, and the error replies in OpenAI's shape."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from swarmlm.api.sampling import LogitRules

# stop strings per request at most: OpenAI takes 4, but lm-eval and vLLM's users send more (a task's stop sequences
# and the end-of-text string); each costs a search of the new text per token
MAX_STOP_STRINGS = 64
# prompts of one /v1/completions request at most (lm-eval sends a list of batch_size of them); each runs as a request
MAX_PROMPTS = 32
# entries of logit_bias at most: a bound on what one request makes the API hold and add per token
MAX_LOGIT_BIAS = 1024
# choices per request: each is a row of the request's session on every server
MAX_CHOICES = 16
# longest stop string accepted (its text is held back while a choice may still end in it)
MAX_STOP_CHARS = 256


class ApiError(Exception):
    """An error reply: HTTP status, OpenAI error type, message, and the parameter or code it concerns."""

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


# chat: most likely alternatives reported per token at most (OpenAI's top_logprobs limit)
MAX_TOP_LOGPROBS = 20
# completions: most likely alternatives reported per token at most (OpenAI's logprobs limit)
MAX_COMPLETION_LOGPROBS = 5


class FieldError(ValueError):
    """A request field this server refuses (a feature it does not implement, or a value that contradicts another
    field): `field` is its name within the object that holds it, the message says what is wrong after the name."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# what to send instead of a field this server refuses, where something else does the job
INSTEAD = {
    "functions": "send 'tools'",
    "function_call": "send 'tool_choice' (and the calls as 'tool_calls')",
    "best_of": "ask for 'n' choices with 'logprobs' and keep the likeliest",
    "suffix": "this model does not fill in the middle: send the text before the gap as the prompt",
    "modalities": "this model takes and writes text only",
    "audio": "this model takes and writes text only",
    "include_obfuscation": "streams are sent unpadded",
}


def refuse_unsupported(data: Any, unsupported: dict[str, tuple[Any, ...]]) -> Any:
    """`data` without the fields OpenAI defines but this server does not implement, when each has a value that asks
    for nothing (null, 0, false, empty); any other value of such a field raises FieldError naming it, the values
    accepted, and what to send instead where something does the job."""
    if not isinstance(data, dict):
        return data
    for name, neutral in unsupported.items():
        if name in data and data[name] not in neutral:
            hint = f"; {INSTEAD[name]}" if name in INSTEAD else ""
            raise FieldError(name, f"is not supported by this server (only {_shown(neutral)}){hint}")
    return {key: value for key, value in data.items() if key not in unsupported}


def _shown(neutral: tuple[Any, ...]) -> str:
    return " or ".join(json.dumps(value) for value in neutral)


class _Strict(BaseModel):
    """Unknown fields are refused by name: a field silently ignored would change the answer without a word. Types are
    strict, as OpenAI's are: "8" is no number of tokens, nor 1 a boolean."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    # OpenAI's fields this server does not implement, with the values that ask for nothing (accepted, dropped)
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, cls.UNSUPPORTED)


class StreamOptions(_Strict):
    UNSUPPORTED = {"include_obfuscation": (None, False)}

    include_usage: bool | None = None


class _Request(_Strict):
    """Fields both endpoints share, checked strictly."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)  # what a generator's seed can be
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # a label of the end user for OpenAI's abuse monitoring: accepted, unused
    # OpenAI's penalties and bias (api/sampling.py), by token id as a string
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # vLLM's sampling extras, as its users send them (the SDK's extra_body puts them at the top level)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)

    @field_validator(
        "temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "top_k", "min_p",
        "repetition_penalty", mode="before",
    )  # fmt: skip
    @classmethod
    def _null_is_default(cls, value: object, info: ValidationInfo) -> object:
        """OpenAI's clients may send these as null, meaning "the default"."""
        if value is None:
            return cls.model_fields[info.field_name or ""].default
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else (stop or [])
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s or len(s) > MAX_STOP_CHARS for s in strings):
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not (token.isascii() and token.isdecimal()):
                raise ValueError(f"keys are token ids (strings of digits), not {token!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"biases are from -100 to 100, not {value} (token {token})")
        return bias

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def rules(self) -> LogitRules:
        bias = tuple((int(token), value) for token, value in (self.logit_bias or {}).items())
        return LogitRules(self.presence_penalty, self.frequency_penalty, self.repetition_penalty, bias,
                          max(self.top_k, 0), self.min_p)  # fmt: skip

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logprob_count(self) -> int | None:
        """None: no log-probabilities; k: each token's, with its k most likely alternatives."""
        return None


RequestT = TypeVar("RequestT", bound=_Request)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


# a function's name as OpenAI allows it
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
# tools in one request at most (OpenAI's limit)
MAX_TOOLS = 128


class CalledFunction(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(_Strict):
    """A call in an assistant message sent back in a following turn."""

    id: str = Field(min_length=1)
    type: Literal["function"]
    function: CalledFunction


# content parts OpenAI defines for what is not text
MEDIA_PARTS = ("image_url", "input_audio", "file", "image", "audio", "input_image", "input_file")


class Message(_Strict):
    # what a reply's message carries besides its text (clients send replies back as they got them); text-only
    # messages have these empty
    UNSUPPORTED = {"refusal": (None,), "function_call": (None,), "audio": (None,), "annotations": (None, [])}

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant's tool calls
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls, sent back with their results
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None  # who speaks (OpenAI's participant name): given to the chat template, which may use it

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """Media parts get a 400 that says why (the model reads text), not a mismatch with the text part's shape."""
        parts = data.get("content") if isinstance(data, dict) else None
        for part in parts if isinstance(parts, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                raise FieldError("content", f"has a part of type '{kind}': this model takes text only (send parts "
                                            "of type 'text', or the content as a string)")  # fmt: skip
        return data

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise FieldError("content", "is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise FieldError("tool_calls", "belong in assistant messages only")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise FieldError("tool_call_id", "is required in tool messages, and only there")
        return self

    def as_template_input(self) -> dict[str, str]:
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        return message if self.name is None else {**message, "name": self.name}


class FunctionSpec(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # the arguments are always held to the schema when a call is forced


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON value
    strict: bool | None = None  # the output always follows the schema (constrained decoding)


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class ChatRequest(_Request):
    UNSUPPORTED = {
        **_Request.UNSUPPORTED,
        "functions": (None, []), "function_call": (None, "none"), "modalities": (None, ["text"]), "audio": (None,),
        "prediction": (None,), "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
        "service_tier": (None, "auto", "default"), "store": (None, False), "moderation": (None,),
        "prompt_cache_retention": (None,), "prompt_cache_options": (None,),
    }  # fmt: skip

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # structured output and tools (api/grammar.py, api/tools.py)
    response_format: ResponseFormat | None = Field(default=None, discriminator="type")
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # labels of the request for OpenAI's own bookkeeping (abuse monitoring, stored completions, its prompt cache):
    # accepted, unused
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatRequest:
        names = [tool.function.name for tool in self.tools or []]
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise FieldError("tool_choice", "needs 'tools'")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise FieldError("tool_choice", f"names '{self.tool_choice.function.name}', which is not in 'tools'")
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "needs 'logprobs': true")
        return self

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


class CompletionRequest(_Request):
    UNSUPPORTED = {**_Request.UNSUPPORTED, "best_of": (None, 1), "suffix": (None, "")}

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    # the completions endpoint generates 16 tokens unless told otherwise; 0 with echo only scores the prompt
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False  # the text (and log-probabilities) of each choice start with its prompt's

    @model_validator(mode="before")
    @classmethod
    def _prompt_shape(cls, data: Any) -> Any:
        """A prompt of another shape gets a 400 naming the shapes accepted, not one of the union's members."""
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if prompt is None or isinstance(prompt, str):
            return data
        if not isinstance(prompt, list) or not prompt:
            raise FieldError("prompt", f"must be {PROMPT_SHAPES}, and not empty")
        kinds = {_prompt_item_kind(item) for item in prompt}
        if len(kinds) != 1 or None in kinds:
            raise FieldError("prompt", f"must be {PROMPT_SHAPES}, each list of one kind of item throughout")
        if kinds != {"token"} and len(prompt) > MAX_PROMPTS:
            raise FieldError("prompt", f"holds {len(prompt)} prompts; at most {MAX_PROMPTS} a request")
        return data

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "may be 0 only with 'echo': true (to score the prompt)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: its text or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(item, int) for item in prompt):
            return [[item for item in prompt if isinstance(item, int)]]
        return [item for item in prompt if isinstance(item, str | list)]

    def logprob_count(self) -> int | None:
        return self.logprobs


def _prompt_item_kind(item: Any) -> str | None:
    """'text', 'token' or 'ids' for an item of a prompt list; None for anything else."""
    if isinstance(item, str):
        return "text"
    if isinstance(item, int) and not isinstance(item, bool):
        return "token"
    if isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        return "ids"
    return None


def parse_body(raw: bytes, schema: type[RequestT]) -> RequestT:
    """The request body as `schema`, or an ApiError 400 naming what is wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"We could not parse the JSON body of your request: {e}") from e
    except RecursionError as e:  # nesting deeper than the parser goes: no request of ours is anything like it
        raise ApiError(400, "We could not parse the JSON body of your request: it is nested too deeply") from e
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = [str(part) for part in first["loc"]]
        refused = first.get("ctx", {}).get("error")
        if isinstance(refused, FieldError):  # raised by a validator of the object holding the field
            named = ".".join([*where, refused.field])
            raise ApiError(400, f"'{named}' {refused}", param=named) from e
        param = ".".join(where) or None
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"Unrecognized request argument supplied: {param}", param=param) from e
        raise ApiError(400, f"Invalid value for '{param}': {first['msg']}", param=param) from e
