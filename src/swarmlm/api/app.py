"""The HTTP front end: OpenAI-compatible routes over the Engine, and the monitor page with its JSON.

Handlers only parse, check and format: generation lives in engine.py, the swarm's picture in monitor.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from importlib import resources
from typing import Any

from aiohttp import web

from swarmlm.api.completions import check_bias, echo_of, merged, prompt_ids, total
from swarmlm.api.engine import (
    ContextTooLongError,
    Delta,
    Echo,
    Engine,
    SamplingParams,
    ShuttingDownError,
    TokenLogprob,
    Usage,
)
from swarmlm.api.grammar import GrammarError, response_format_grammar
from swarmlm.api.logprobs import TokenNames, chat_content, completion_lists
from swarmlm.api.metrics import CONTENT_TYPE, ApiMetrics
from swarmlm.api.monitor import Monitor
from swarmlm.api.schemas import ApiError, ChatRequest, CompletionRequest, _Request, parse_body
from swarmlm.api.tools import ToolCall, ToolDelta, ToolPlan, plan_tools, with_tool_calls
from swarmlm.errors import BadRequestError, MissingBlocksError, SwarmError

logger = logging.getLogger(__name__)

# largest request body accepted (a long conversation is far smaller)
MAX_BODY_BYTES = 4 << 20
STATIC = resources.files("swarmlm.api") / "static"
PAGES = {"/": ("index.html", "text/html"), "/monitor.js": ("monitor.js", "application/javascript"),
         "/monitor.css": ("monitor.css", "text/css")}  # fmt: skip


# the paths an API key guards: those that spend the swarm's compute. The monitor (page and JSON) shows what any
# member of the swarm reads from its DHT, /health is for load balancers and /metrics for scrapers, which send no key
KEYED_PREFIX = "/v1/"
# where api_key_check leaves the user a request's key stands for
USER_KEY = web.RequestKey("swarmlm_user", str)
# IPv6 clients are one user per /64 network: one machine gets a whole /64 as easily as one address (as servers group
# their peers' hosts, server/fairness.py)
IPV6_USER_PREFIX = 64


def openai_errors(metrics: ApiMetrics | None = None) -> Any:
    """A middleware: every failure becomes an error reply in OpenAI's shape (counted in `metrics` by its kind);
    none escapes to kill the server."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            error = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            error = ApiError(e.status, f"{e.reason}: {request.method} {request.path}", kind=kind)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - an unexpected failure fails this request only
            logger.exception("Request %s %s failed", request.method, request.path)
            error = ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
        if metrics is not None:
            metrics.error(error.code or error.kind)
        response = error.response()
        if error.status == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        return response

    return middleware


def key_user(api_key: str) -> str:
    """The user an API key stands for: a digest of it, so that no log or figure shows the key."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


def api_key_check(api_keys: Sequence[str]) -> Any:
    """A middleware: requests to the API's paths must carry `Authorization: Bearer <key>` with one of `api_keys` (as
    OpenAI's clients send their api_key), else they get a 401 in OpenAI's shape. The key names the request's user."""
    expected = [(key.encode(), key_user(key)) for key in api_keys]

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith(KEYED_PREFIX):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not given:
                raise ApiError(401, "You didn't provide an API key: send it as 'Authorization: Bearer KEY'.",
                               code="invalid_api_key")  # fmt: skip
            presented, user = given.strip().encode(), None
            for key, name in expected:  # each compared in constant time, and all of them: no guessing by timing
                if hmac.compare_digest(presented, key):
                    user = name
            if user is None:
                raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
            request[USER_KEY] = user
        return await handler(request)

    return middleware


def user_of(request: web.Request) -> str:
    """Who a request is from, for sharing the API's slots (api/fair.py) and cache (api/cache_share.py) fairly: the API
    key it presented when keys are on, else the client's address (its /64 network for IPv6). Never the body's `user`
    field: any client may write any name there."""
    user = request.get(USER_KEY)
    if user is not None:
        return user
    return address_user(request.remote or "unknown")


def address_user(address: str) -> str:
    """The user of a client address: the address, an IPv6 one as its /64 network."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # an IPv4 client of a dual-stack socket
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/{IPV6_USER_PREFIX}", strict=False))
    return str(ip)


def swarm_error(error: Exception) -> ApiError:
    """The reply for a failure while generating."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, GrammarError):
        return ApiError(400, f"the output's grammar cannot be enforced: {error}")
    if isinstance(error, ShuttingDownError):
        return ApiError(503, str(error), kind="service_unavailable", code="shutting_down")
    if isinstance(error, MissingBlocksError):
        return ApiError(503, str(error), kind="service_unavailable", code="missing_blocks")
    if isinstance(error, BadRequestError):
        return ApiError(400, f"the servers refused the request: {error}")
    if isinstance(error, SwarmError):
        return ApiError(503, f"the swarm could not serve the request: {error}", kind="service_unavailable")
    return ApiError(500, f"internal error: {type(error).__name__}: {error}", kind="server_error")


class Routes:
    """The routes of one server: the API when it has an engine, the monitor always."""

    def __init__(
        self, engine: Engine | None, model_names: tuple[str, ...], monitor: Monitor, body_timeout_s: float = 15.0,
        api_keys: tuple[str, ...] = (),
    ):  # fmt: skip
        self.engine, self.model_names, self.monitor, self.api_keys = engine, model_names, monitor, api_keys
        self.body_timeout_s = body_timeout_s  # longest a request's body may take to arrive
        self.created = int(time.time())
        self.names = None if engine is None else TokenNames(engine.tokenizer)

    def app(self) -> web.Application:
        metrics = None if self.engine is None else self.engine.metrics
        middlewares = [openai_errors(metrics)] + ([api_key_check(self.api_keys)] if self.api_keys else [])
        app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
        for path in PAGES:
            app.router.add_get(path, self.page)
        app.router.add_get("/api/v1/swarm", self.swarm)
        app.router.add_get("/health", self.health)
        if self.engine is not None:
            app.router.add_get("/metrics", self.metrics)
            app.router.add_get("/v1/models", self.models)
            app.router.add_post("/v1/chat/completions", self.chat)
            app.router.add_post("/v1/completions", self.completions)
        return app

    async def page(self, request: web.Request) -> web.Response:
        name, content_type = PAGES[request.path]
        return web.Response(body=(STATIC / name).read_bytes(), content_type=content_type)

    async def swarm(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(await self.monitor.snapshot())
        except TimeoutError as e:
            raise ApiError(503, "the DHT did not answer in time", kind="service_unavailable") from e

    async def health(self, request: web.Request) -> web.Response:
        """For load balancers: 200 while this server takes requests, 503 once it is shutting down. It reads no DHT
        (a balancer asks often): whether the swarm covers the model is the monitor's to show."""
        if self.engine is not None and self.engine.closing:
            raise ApiError(503, "shutting down", kind="service_unavailable", code="shutting_down")
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        engine = self._engine_only()
        running = engine.generating
        waiting = max(0, engine.in_progress() - running)
        gauges = {
            "requests_running": ("requests generating now, each with an inference session open", running),
            "requests_waiting": ("requests waiting for a free slot (--max-concurrent)", waiting),
        }
        return web.Response(body=engine.metrics.render(gauges).encode(), headers={"Content-Type": CONTENT_TYPE})

    def _engine_only(self) -> Engine:
        if self.engine is None:
            raise ApiError(404, "this server has no model")
        return self.engine

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": self.model_names[0], "object": "model", "created": self.created, "owned_by": "swarmlm"}]
        return web.json_response({"object": "list", "data": data})

    async def _body(self, request: web.Request) -> bytes:
        """The request's body, within body_timeout_s (a body sent a byte at a time would hold a handler for ever)."""
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await request.read()
        except TimeoutError as e:
            raise ApiError(408, f"the request's body did not arrive within {self.body_timeout_s:.0f} s") from e

    def _engine(self, body: _Request) -> Engine:
        engine = self._engine_only()
        if body.model not in self.model_names:
            message = f"The model '{body.model}' does not exist; this server serves '{self.model_names[0]}'."
            raise ApiError(404, message, param="model", code="model_not_found")
        return engine

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = parse_body(await self._body(request), ChatRequest)
        engine = self._engine(body)
        try:
            plan = plan_tools(body, getattr(engine.tokenizer, "chat_template", None))
        except GrammarError as e:
            raise ApiError(400, f"'tools' cannot be enforced: {e}", param="tools") from e
        try:
            prompt = engine.chat_prompt(plan.messages, tools=plan.template_tools)
        except Exception as e:  # noqa: BLE001 - the template rejects a conversation its own way (jinja errors)
            raise ApiError(400, f"The chat template rejected the messages: {e}", param="messages") from e
        grammar = await self._grammar(engine, body, plan)
        tools = plan if plan.parsed and body.tool_choice != "none" else None
        return await self._complete(
            request, body, [prompt], body.new_tokens(), chat=True, grammar=grammar, tools=tools
        )

    async def _grammar(self, engine: Engine, body: ChatRequest, plan: ToolPlan) -> str | None:
        """The grammar the answer must follow (a forced tool call's, else response_format's), checked: what it cannot
        enforce is a 400 naming the field and the schema's unsupported features."""
        param = "tools" if plan.grammar else "response_format.json_schema.schema"
        try:
            grammar = plan.grammar or response_format_grammar(body.response_format)
            if grammar is not None:
                await asyncio.to_thread(engine.grammars.check, grammar)  # up to the parser limits: not on the loop
        except GrammarError as e:
            raise ApiError(400, f"'{param}' cannot be enforced: {e}", param=param) from e
        return grammar

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = parse_body(await self._body(request), CompletionRequest)
        engine = self._engine(body)
        texts_or_ids = body.prompts()
        prompts = [prompt_ids(engine, prompt, index) for index, prompt in enumerate(texts_or_ids)]
        echoes = None
        if body.echo and self.names is not None:
            echoes = [echo_of(prompt, ids, self.names) for prompt, ids in zip(texts_or_ids, prompts, strict=True)]
        return await self._complete(request, body, prompts, body.max_tokens, chat=False, echoes=echoes)

    async def _complete(
        self, request: web.Request, body: _Request, prompts: list[list[int]], new_tokens: int | None, chat: bool,
        grammar: str | None = None, tools: ToolPlan | None = None, echoes: list[Echo] | None = None,
    ) -> web.StreamResponse:  # fmt: skip
        """The answer to `prompts` (chat's one; each prompt's choices are n of the answer's, echoes: what their text
        starts with), whole or streamed."""
        engine = self._engine(body)
        try:
            max_new_tokens = min(engine.check_fits(len(prompt), new_tokens) for prompt in prompts)
        except ContextTooLongError as e:
            raise ApiError(400, str(e), param="messages" if chat else "prompt", code="context_length_exceeded") from e
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        logprobs, rules = body.logprob_count(), body.rules()
        check_bias(rules, engine)
        params = SamplingParams(max_new_tokens, body.temperature, body.top_p, body.stop_strings(), body.seed, body.n,
                                logprobs, rules)  # fmt: skip
        params = dataclasses.replace(params, grammar=grammar)
        names = self.names if logprobs is not None else None
        reply = Reply(chat, body.model, body.n * len(prompts), body.include_usage(), names)
        usage: list[Usage] = []
        generation = merged([engine.stream(prompt, params, usage, user_of(request), echoes[i] if echoes else None)
                             for i, prompt in enumerate(prompts)], body.n)  # fmt: skip
        if tools is not None:  # answers are read as tool calls at their end
            generation = with_tool_calls(generation, tools, body.n)
        async with contextlib.aclosing(generation) as deltas:
            try:
                first = await anext(deltas, None)  # errors before the first token get a plain error reply
            except Exception as e:  # noqa: BLE001 - mapped to its HTTP status
                raise swarm_error(e) from e
            if not body.stream:
                return await self._whole(reply, first, deltas, usage)
            return await self._stream(request, reply, first, deltas, usage)

    async def _whole(
        self, reply: Reply, first: Delta | None, deltas: AsyncGenerator[Delta], usage: list[Usage]
    ) -> web.Response:
        texts, reasons = [""] * reply.n, list[str | None]([None] * reply.n)
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(reply.n)]
        calls: list[tuple[ToolCall, ...]] = [() for _ in range(reply.n)]
        try:
            rest = [delta async for delta in deltas]
        except Exception as e:  # noqa: BLE001 - mapped to its HTTP status
            raise swarm_error(e) from e
        for delta in ([first] if first else []) + rest:
            texts[delta.index] += delta.text
            reasons[delta.index] = delta.finish_reason or reasons[delta.index]
            logprobs[delta.index] += delta.logprobs
            if isinstance(delta, ToolDelta):
                calls[delta.index] = delta.tool_calls
        return web.json_response(reply.whole(texts, reasons, total(usage), logprobs, calls))

    async def _stream(
        self,
        request: web.Request,
        reply: Reply,
        first: Delta | None,
        deltas: AsyncGenerator[Delta],
        usage: list[Usage],
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in reply.opening():
            await _send(response, chunk)
        try:
            if first is not None:
                await _send(response, reply.chunk(first))
            async for delta in deltas:
                await _send(response, reply.chunk(delta))
            if reply.include_usage and usage:
                await _send(response, reply.usage_chunk(total(usage)))
        except (ConnectionError, asyncio.CancelledError):
            raise  # the client went away: aclosing() stops the generation and closes its session
        except Exception as e:  # noqa: BLE001 - headers are sent: the error travels as an event
            error = swarm_error(e)
            self._engine_only().metrics.error(error.code or error.kind)
            await _send(response, error.body())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _send(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(data).encode() + b"\n\n")


class Reply:
    """The JSON bodies of one request's answer, in the shape of its endpoint."""

    def __init__(self, chat: bool, model: str, n: int, include_usage: bool, names: TokenNames | None = None):
        self.chat, self.model, self.n, self.include_usage = chat, model, n, include_usage
        self.names = names  # set when the request asked for log-probabilities
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if chunk and self.include_usage:
            body["usage"] = None
        return body

    def opening(self) -> list[dict[str, Any]]:
        """Chat streams first tell each choice's role."""
        if not self.chat:
            return []
        return [self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                                 "logprobs": None}], chunk=True) for i in range(self.n)]  # fmt: skip

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if self.names is None:
            return None
        return chat_content(entries, self.names) if self.chat else completion_lists(entries, self.names)

    def chunk(self, delta: Delta) -> dict[str, Any]:
        logprobs = self._logprobs(delta.logprobs) if delta.logprobs else None
        choice: dict[str, Any] = {"index": delta.index, "finish_reason": delta.finish_reason, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = {"content": delta.text} if delta.text else {}
            if isinstance(delta, ToolDelta):
                choice["delta"]["tool_calls"] = [call.shape(i) for i, call in enumerate(delta.tool_calls)]
        else:
            choice["text"] = delta.text
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope([], chunk=True), "usage": _usage(usage)}

    def whole(
        self, texts: list[str], reasons: list[str | None], usage: Usage, logprobs: list[list[TokenLogprob]],
        tool_calls: list[tuple[ToolCall, ...]] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        choices = []
        for index, (text, reason, entries) in enumerate(zip(texts, reasons, logprobs, strict=True)):
            choice: dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": self._logprobs(entries)}
            calls = tool_calls[index] if tool_calls else ()
            if self.chat and calls:  # OpenAI's shape: content null unless the model wrote text before its calls
                choice["message"] = {"role": "assistant", "content": text or None,
                                     "tool_calls": [call.shape() for call in calls]}  # fmt: skip
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {**self._envelope(choices, chunk=False), "usage": _usage(usage)}


def _usage(usage: Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}  # fmt: skip
