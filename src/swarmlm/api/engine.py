"""Completions for the HTTP API: one inference session per request, tokens decoded and streamed as text deltas.

Requests run as coroutines on the client's own event loop, beside the sessions' network work: each opens its own
session through the swarm, so concurrent requests reach the servers together and their decode steps batch there, and
the LM heads of steps that come back together run as one product (model.anext_logits). No thread is held per
request. A request's choices (n) are the rows of one session. Cancelling a stream (a client that went away) stops
its decoding at the next token and closes its session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from swarmlm.api.cache_share import CacheBusyError, CacheLedger
from swarmlm.api.choices import ChoiceText, SamplingParams, next_tokens
from swarmlm.api.fair import FairSlots
from swarmlm.api.grammar import Grammars, masked
from swarmlm.api.metrics import ApiMetrics
from swarmlm.api.sampling import Penalties
from swarmlm.api.scoring import TokenLogprob, prompt_logprobs, token_logprobs
from swarmlm.client.model import DistributedCausalLMMixin

if TYPE_CHECKING:
    from swarmlm.client.generation import GenerationSession

logger = logging.getLogger(__name__)

# how many finished requests the monitor's latency table keeps
RECENT_REQUESTS = 20
# new tokens a generation's session holds room for at first (server/cache.py budgets are per token)
INITIAL_RESERVE = 256


def reservation(prompt: int, generated: int, max_new: int, current: int, initial: int = INITIAL_RESERVE) -> int:
    """The session length to hold for a generation of up to max_new tokens after `prompt`, `generated` of them made
    in a session of `current` (0: none yet): the prompt and `initial` new tokens, then twice as many new tokens each
    time they are used up (so replaying the history into a larger session costs at most about twice the tokens),
    never more than the request may generate."""
    if current == 0:
        return prompt + min(max_new, initial)
    return prompt + min(max_new, max(initial, 2 * (current - prompt), generated + 1))


class ContextTooLongError(ValueError):
    """The prompt plus the tokens asked for do not fit the model's context."""


class ShuttingDownError(RuntimeError):
    """The API server is stopping: requests still generating end with this, new ones are refused."""

    def __init__(self) -> None:
        super().__init__("the API server is shutting down")


@dataclass(frozen=True)
class Echo:
    """The prompt repeated before each choice's text (the completions endpoint's echo): its text, and where each of its
    tokens' text begins in it (for the tokens' log-probabilities, when asked)."""

    text: str
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class Delta:
    """New text of one choice; finish_reason ("stop" or "length") on its last delta; the log-probabilities of the
    tokens generated since the previous delta (when asked for; the end-of-sequence token has none)."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class RequestStats:
    """One finished request, as the monitor shows it."""

    finished_at: float  # unix time
    time_to_first_token_s: float | None
    completion_tokens: int
    duration_s: float
    outcome: str  # "ok", "cancelled" or the error's class name


_END = object()


@dataclass
class Engine:
    """The model and its tokenizer; requests generate as coroutines on the model's client loop."""

    model: DistributedCausalLMMixin
    tokenizer: Any  # transformers' tokenizers return unions that depend on their flags
    context_tokens: int  # the model's context: prompt plus new tokens must fit
    max_concurrent: int  # requests generating at once; more wait for their turn
    # a session first holds the prompt and this many new tokens on the servers, and grows when they are used (the
    # history replayed into a larger one), so a request asking for the whole context does not hold it from the start
    initial_reserve: int = INITIAL_RESERVE
    # session tokens (batch x length) the API's sessions may hold on the servers, shared by its users
    # (api/cache_share.py); None: unknown yet, nothing is bounded
    cache_budget_tokens: Callable[[], int | None] = lambda: None
    recent: deque[RequestStats] = field(default_factory=lambda: deque(maxlen=RECENT_REQUESTS))
    metrics: ApiMetrics = field(default_factory=ApiMetrics)  # what GET /metrics reports
    route: list[tuple[str, int, int]] = field(default_factory=list)  # (peer, start, end) of the last session opened

    def __post_init__(self) -> None:
        self._slots = FairSlots(self.max_concurrent)  # shared by users, on the client's loop only
        self.cache = CacheLedger(self.cache_budget_tokens)  # the servers' cache, shared by users (client's loop)
        self._tasks: set[asyncio.Task[None]] = set()  # requests generating or waiting for a slot (client's loop)
        self.closing = False
        self.generating = 0  # requests holding a slot, each with its inference session (client's loop)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.grammars = Grammars(self.tokenizer, self.eos_ids, self.model.config.vocab_size)  # structured output

    def in_progress(self) -> int:
        """Requests generating or waiting for a slot."""
        return len(self._tasks)

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation (and the tools offered, api/tools.py) rendered by the model's chat template,
        ready for the assistant's answer."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: use /v1/completions")
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=True)
        return list(ids["input_ids"])

    def text_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def check_fits(self, prompt_tokens: int, max_new_tokens: int | None) -> int:
        """The number of new tokens to generate: max_new_tokens, or by default what is left of the context."""
        if prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        left = self.context_tokens - prompt_tokens
        if max_new_tokens is None:
            if left < 1:
                raise ContextTooLongError(
                    f"This model's maximum context length is {self.context_tokens} tokens; "
                    f"the prompt has {prompt_tokens} tokens."
                )
            return left
        if max_new_tokens > left:
            raise ContextTooLongError(
                f"This model's maximum context length is {self.context_tokens} tokens. However, you requested "
                f"{prompt_tokens + max_new_tokens} tokens ({prompt_tokens} in the prompt, {max_new_tokens} for the "
                "completion). Please reduce the prompt or the completion length."
            )
        return max_new_tokens

    async def stream(
        self, prompt: list[int], params: SamplingParams, usage: list[Usage], user: str = "", echo: Echo | None = None
    ) -> AsyncGenerator[Delta]:
        """The choices' text deltas as they are generated (after the prompt's, with `echo`); `usage` gets the token
        counts at the end. Closing the iterator early (the client went away) stops the generation and closes its
        session."""
        if self.closing:
            raise ShuttingDownError
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        cancelled = threading.Event()

        def emit(item: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: the server is shutting down
                loop.call_soon_threadsafe(queue.put_nowait, item)

        began = time.perf_counter()
        stats: dict[str, Any] = {"first": None, "tokens": 0, "outcome": "cancelled"}
        try:
            self.model.client.loop.submit(self._run(prompt, params, emit, cancelled, stats, user, echo))
        except RuntimeError as e:  # the client's loop is closed
            stats["outcome"] = type(e).__name__
            raise RuntimeError("the swarm connection is closed") from e
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, Usage):
                    usage.append(item)
                elif isinstance(item, BaseException):
                    raise item
                elif isinstance(item, Delta):
                    yield item
        finally:
            cancelled.set()
            first = stats["first"]
            done = RequestStats(time.time(), None if first is None else first - began, stats["tokens"],
                                time.perf_counter() - began, stats["outcome"])  # fmt: skip
            self.recent.append(done)
            self.metrics.finished(done.outcome, len(prompt), done.completion_tokens, done.time_to_first_token_s,
                                  done.duration_s)  # fmt: skip

    async def _run(
        self,
        prompt: list[int],
        params: SamplingParams,
        emit: Callable[[object], None],
        cancelled: threading.Event,
        stats: dict[str, Any],
        user: str = "",
        echo: Echo | None = None,
    ) -> None:
        """Generate on the client's loop, once a slot is free (api/fair.py: `user`'s turn); every result and error
        goes through emit, then _END."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            async with self._slots.hold(user):
                if not cancelled.is_set():
                    self.generating += 1
                    try:
                        await self._generate(prompt, params, emit, cancelled, stats, user, echo)
                    finally:
                        self.generating -= 1
            if not cancelled.is_set():
                stats["outcome"] = "ok"
        except Exception as e:  # noqa: BLE001 - any failure is the request's, handed to its handler
            stats["outcome"] = type(e).__name__
            if not cancelled.is_set():
                logger.info("A request failed: %s", e)
            emit(e)
        except asyncio.CancelledError:  # close(): the server is stopping
            emit(ShuttingDownError())
            raise
        finally:
            self._tasks.discard(task)
            emit(_END)

    async def _generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        emit: Callable[[object], None],
        cancelled: threading.Event,
        stats: dict[str, Any],
        user: str,
        echo: Echo | None = None,
    ) -> None:
        generator = torch.Generator().manual_seed(random.getrandbits(63) if params.seed is None else params.seed)
        choices = [ChoiceText(self.tokenizer, params.stop, self.eos_ids) for _ in range(params.n)]
        pending: list[list[TokenLogprob]] = [[] for _ in range(params.n)]  # per choice, not yet in a delta
        shift = 0 if echo is None else len(echo.text)  # the generated tokens' text comes after the echoed prompt
        scores_prompt = echo is not None and params.logprobs is not None
        if echo is not None and not scores_prompt:  # the prompt's text alone: no forward needed for it
            for index in range(params.n):
                emit(Delta(index, echo.text))
        if params.max_new_tokens > 0 or scores_prompt:
            state = (generator, choices, pending, shift)
            await self._decode(prompt, params, emit, cancelled, stats, state, user, echo)
        if cancelled.is_set():
            return
        for index, choice in enumerate(choices):
            if choice.finish_reason is None:
                emit(Delta(index, choice.finish("length"), "length", tuple(pending[index])))
        emit(Usage(len(prompt), stats["tokens"]))

    async def _decode(
        self,
        prompt: list[int],
        params: SamplingParams,
        emit: Callable[[object], None],
        cancelled: threading.Event,
        stats: dict[str, Any],
        state: tuple[torch.Generator, list[ChoiceText], list[list[TokenLogprob]], int],
        user: str,
        echo: Echo | None,
    ) -> None:
        """The prompt's forward, then token after token through one inference session until every choice ends or
        max_new_tokens are made. The session's room comes from the user's share of the API's cache (CacheBusyError
        when none comes free in time); when it is used up, or the share asks it back, the session closes and the
        tokens so far are replayed into a new one once room is granted (the choices end "length" if none is)."""
        generator, choices, pending, shift = state
        ids = torch.tensor([prompt] * params.n, dtype=torch.long)  # (n, tokens)
        reserved = reservation(len(prompt), 0, params.max_new_tokens, 0, self.initial_reserve)
        lease = await self.cache.acquire(user, params.n * reserved)
        session = self.model.inference_session(max_length=reserved)
        try:
            if cancelled.is_set():
                return
            logits = await self._first_logits(session, ids, prompt, params, emit, echo)  # (n, vocab)
            stats["first"] = time.perf_counter()
            self.route = [(span.peer_id, span.start, span.end) for span in session.route]
            penalties = Penalties(params.rules, prompt, params.n, logits.shape[-1])
            guide = None if params.grammar is None else await asyncio.to_thread(self.grammars.guide, params.grammar,
                                                                               params.n)  # fmt: skip
            for generated in range(params.max_new_tokens):
                if generated:
                    if cancelled.is_set():
                        return
                    if lease.paused or len(prompt) + generated > reserved:  # room asked back, or used up
                        if len(prompt) + generated > reserved:
                            reserved = reservation(
                                len(prompt), generated, params.max_new_tokens, reserved, self.initial_reserve
                            )
                        await session.aclose()
                        self.cache.release(lease)
                        try:
                            lease = await self.cache.acquire(user, params.n * reserved)
                        except CacheBusyError:
                            return  # no room in time: the answer so far, ended "length"
                        session = self.model.inference_session(max_length=reserved)  # replays the tokens so far
                    logits = await self.model.anext_logits(session, ids)  # (n, vocab)
                with torch.inference_mode():
                    chosen = next_tokens(masked(guide, penalties.apply(logits)), params, generator)
                    scored = token_logprobs(logits, chosen, params.logprobs)
                penalties.add(chosen)
                for index, choice in enumerate(choices):
                    if choice.finish_reason is None:
                        stats["tokens"] += 1
                        token = int(chosen[index])
                        if scored is not None:  # the end-of-sequence token's entry too: its likelihood is news
                            logprob, top = scored[index]
                            pending[index].append(TokenLogprob(token, logprob, top, shift + choice.decoded))
                        text = choice.add(token)
                        if guide is not None and choice.finish_reason is None and guide.ended(index, token):
                            text += choice.finish("stop")  # the grammar is complete: nothing may follow
                        if text or choice.finish_reason:
                            emit(Delta(index, text, choice.finish_reason, tuple(pending[index])))
                            pending[index].clear()
                if all(choice.finish_reason for choice in choices):
                    break
                ids = torch.cat([ids, chosen[:, None]], dim=1)
        finally:
            await session.aclose()
            self.cache.release(lease)

    async def _first_logits(
        self,
        session: GenerationSession,
        ids: torch.Tensor,
        prompt: list[int],
        params: SamplingParams,
        emit: Callable[[object], None],
        echo: Echo | None,
    ) -> torch.Tensor:
        """The logits (n, vocab) after the prompt. With echo and logprobs, each choice's first delta is the prompt
        with its tokens' log-probabilities, from the same forward of the prompt through the swarm."""
        if echo is None or params.logprobs is None:
            return await self.model.anext_logits(session, ids)
        hidden = await self.model.anext_hidden(session, ids)  # (n, prompt, hidden): the rows are equal
        entries = await prompt_logprobs(self.model.ahead_logits, prompt, hidden[0], params.logprobs, echo.offsets)
        for index in range(params.n):
            emit(Delta(index, echo.text, None, entries))
        return await self.model.ahead_logits(hidden[:, -1])

    def close(self) -> None:
        """Refuse new requests, end those still generating (with ShuttingDownError), and wait (a little) for their
        sessions to close."""
        self.closing = True

        async def stop_all() -> None:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(RuntimeError, TimeoutError):  # the loop is closed already, or a close hangs
            self.model.client.loop.run(stop_all(), timeout=10)
