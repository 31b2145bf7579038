"""The OpenAI-compatible requests the API accepts, validated strictly, and the error replies in OpenAI's shape."""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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


class _Request(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored (clients send many optional ones); the fields used
    here are checked strictly."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None

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
        return bool(self.stream_options and self.stream_options.get("include_usage"))


RequestT = TypeVar("RequestT", bound=_Request)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str]
    echo: bool = False
    logprobs: int | None = None
    # the completions endpoint generates 16 tokens unless told otherwise
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError("give one prompt (a string, or a list of one string)")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: int | None) -> int | None:
        if logprobs is not None:
            raise ValueError("logprobs are not supported")
        return logprobs

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def parse_body(raw: bytes, schema: type[RequestT]) -> RequestT:
    """The request body as `schema`, or an ApiError 400 naming what is wrong."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"We could not parse the JSON body of your request: {e}") from e
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise ApiError(400, f"Invalid value for '{param}': {first['msg']}", param=param) from e
