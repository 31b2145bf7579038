"""The OpenAI-compatible requests the API accepts, validated strictly, and the error replies in OpenAI's shape."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

# OpenAI accepts at most this many stop strings
MAX_STOP_STRINGS = 4
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


def refuse_unsupported(data: Any, unsupported: dict[str, tuple[Any, ...]]) -> Any:
    """`data` without the fields OpenAI defines but this server does not implement, when each has a value that asks
    for nothing (null, 0, false, empty); any other value of such a field raises FieldError naming it."""
    if not isinstance(data, dict):
        return data
    for name, neutral in unsupported.items():
        if name in data and data[name] not in neutral:
            raise FieldError(name, f"is not supported by this server (only {_shown(neutral)})")
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

    UNSUPPORTED = {"frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {})}

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

    @field_validator("temperature", "top_p", "n", "stream", mode="before")
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

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logprob_count(self) -> int | None:
        """None: no log-probabilities; k: each token's, with its k most likely alternatives."""
        return None


RequestT = TypeVar("RequestT", bound=_Request)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    # what a reply's message carries besides its text (clients send replies back as they got them) and what only
    # tools use; text-only messages have these empty
    UNSUPPORTED = {"name": (None,), "refusal": (None,), "tool_calls": (None, []), "function_call": (None,),
                   "audio": (None,), "annotations": (None, []), "tool_call_id": (None,)}  # fmt: skip

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Request):
    UNSUPPORTED = {
        **_Request.UNSUPPORTED,
        "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
        "parallel_tool_calls": (None, True, False),  # without tools it means nothing
        "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]), "audio": (None,),
        "prediction": (None,), "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
        "service_tier": (None, "auto", "default"), "store": (None, False), "moderation": (None,),
        "prompt_cache_retention": (None,), "prompt_cache_options": (None,),
    }  # fmt: skip

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # labels of the request for OpenAI's own bookkeeping (abuse monitoring, stored completions, its prompt cache):
    # accepted, unused
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "needs 'logprobs': true")
        return self

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    UNSUPPORTED = {**_Request.UNSUPPORTED, "echo": (None, False), "best_of": (None, 1), "suffix": (None, "")}

    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    # the completions endpoint generates 16 tokens unless told otherwise
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError("give one prompt (a string, or a list of one string)")
        return prompt

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def logprob_count(self) -> int | None:
        return self.logprobs


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
