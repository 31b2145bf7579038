"""The server's scheduler: orders work by class and by peer, forms batches, and feeds the one compute thread."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, cast

import torch
from transformers.cache_utils import DynamicCache

from swarmlm.server.joining import JoinableRequest, can_join
from swarmlm.server.load import DepthMeter, turns_ahead

logger = logging.getLogger(__name__)

# peers remembered for fair share beyond those with queued work; older ones are forgotten (they rejoin as new)
MAX_REMEMBERED_PEERS = 1024


class Kind(IntEnum):
    """Classes of work, most urgent first: a waiting generation step costs a user latency on every token."""

    INFERENCE = 0
    FORWARD = 1
    BACKWARD = 2


@dataclass(frozen=True, eq=False)
class DecodeStep:
    """A one-token step of a session that may share one forward with other sessions' steps; or the prompt of a fresh
    session (several tokens, one row), which may share one forward with other fresh sessions' prompts."""

    start: int  # blocks [start, end): only steps over the same blocks run together
    end: int
    hidden: torch.Tensor  # (rows, 1, hidden), as received
    cache: DynamicCache  # the session's own cache, which the step extends by one token
    adapter: str | None = None  # the session's LoRA adapter: only steps with the same one share a forward
    mask: torch.Tensor | None = None  # (rows, history + 1): the session's padding mask (None: no padding)
    positions: torch.Tensor | None = None  # (rows, 1): the rows' position ids (None: the history's length)
    budget: int = 0  # of a prompt: the most tokens of all prompts in the forward it joins (the server's chunk)

    @property
    def rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def tokens(self) -> int:
        return self.hidden.shape[1]

    @property
    def prompt(self) -> bool:
        """A fresh session's prompt (several tokens) rather than a one-token decode step."""
        return self.hidden.shape[1] > 1

    @property
    def key(self) -> tuple[int, int, str | None, bool]:
        """Its blocks, adapter and kind (prompt or decode step): only steps with the same key run as one forward."""
        return self.start, self.end, self.adapter, self.prompt


@dataclass(eq=False)
class Task:
    """One request waiting for the compute thread."""

    kind: Kind
    peer: str
    seq: int  # arrival order
    run: Callable[[], Any]  # runs this request alone, on the compute thread; may return a generator (see below)
    decode: DecodeStep | None = None  # set when it may instead join a batched decode step
    join: JoinableRequest | None = None  # set when a forward/backward may run joined with others of its kind
    future: asyncio.Future[Any] | None = field(default=None, repr=False)
    # a long request runs as a generator yielding between quanta (blocks): it goes back into the queue after each
    # quantum, so more urgent work (inference steps) and other peers' turns run in between; its return is the result
    quanta: Generator[None, None, Any] | None = field(default=None, repr=False)
    members: list[Task] | None = field(default=None, repr=False)  # of a joined task: the requests it runs
    arrived: float = 0.0  # time.monotonic() when it was queued
    # of a prompt left over when prompts waiting together were split into groups: the size of each group (the rest
    # of the wave is not split again)
    group: int = 0


@dataclass(frozen=True)
class BatchLimits:
    max_sessions: int = 32  # sessions in one batched decode step
    max_rows: int = 64  # batch rows (sum of the sessions' batch sizes) in one batched decode step
    max_join_tokens: int = 2048  # batch x sequence tokens of forward (or backward) requests joined into one
    max_join_requests: int = 16  # requests joined into one forward (or backward)
    # a decode batch missing steps of sessions that stepped recently (over the same blocks) waits at most this long
    # for them: concurrent sessions fall into step and share forwards, which on a CPU cost little more than one
    decode_wait_s: float = 0.1
    active_s: float = 1.0  # a session that sent a decode step this recently is expected to send the next one
    # servers a session's steps pass through, this one included (the model's blocks / this span's): with more than
    # one, the active sessions over a span form that many cohorts, and a decode batch holds (and waits for) one
    # cohort. Each server then computes one cohort while the others are elsewhere in the chain (pipelining), where
    # one cohort of all sessions would leave every server idle until it comes round again. A server that is behind
    # (busy almost all the time: SATURATED_SHARE) batches all the steps it has instead.
    stages: int = 1
    # of those, how many come after this one: fresh sessions' prompts waiting together run as 1 + later_stages
    # forwards (the next server starts on the first while this one computes the next); the last server joins them
    later_stages: int = 0


def next_batch(queue: Sequence[Task], limits: BatchLimits, last_served: Mapping[str, int]) -> list[Task]:
    """The tasks to run next: from the most urgent class present, the waiting task of the peer served least
    recently (round robin between peers; arrival order breaks ties), joined, if it is a decode step (or a fresh
    session's prompt), by the other decode steps (prompts) over the same blocks with the same adapter, peers in the
    same order, within `limits` (and, for prompts, their tokens within the head's budget). Empty only for an empty
    queue."""
    if not queue:
        return []
    kind = min(task.kind for task in queue)
    order = sorted((t for t in queue if t.kind == kind), key=lambda t: (last_served.get(t.peer, -1), t.seq))
    head = order[0]
    if head.join is not None and head.quanta is None:
        return _joined(head, order[1:], limits)
    if head.decode is None:
        return [head]
    batch, rows, caches = [head], head.decode.rows, {id(head.decode.cache)}
    tokens, budget = head.decode.tokens, min(limits.max_join_tokens, head.decode.budget)
    for task in order[1:]:
        step = task.decode
        if len(batch) >= limits.max_sessions:
            break
        if step is None or not _same_forward(step, head.decode):
            continue
        if rows + step.rows > limits.max_rows or id(step.cache) in caches:
            continue
        if step.prompt and tokens + step.tokens > budget:
            continue
        batch.append(task)
        rows += step.rows
        tokens += step.tokens
        caches.add(id(step.cache))
    return batch


def _same_forward(step: DecodeStep, head: DecodeStep) -> bool:
    """Steps run as one forward only over the same blocks with the same LoRA adapter, and prompts only with
    prompts."""
    return step.key == head.key


def _wanted(task: Task) -> bool:
    """Whether someone still waits for the task's result (for a joined task: any of its requests' callers)."""
    if task.future is None or task.future.done():
        return False
    if task.members is not None and all(m.future is None or m.future.done() for m in task.members):
        task.future.cancel()  # every caller gave up: its remaining blocks need not run
        return False
    return True


def _joined(head: Task, others: Sequence[Task], limits: BatchLimits) -> list[Task]:
    """head with the waiting, not yet started requests of its kind that can join it, in order, within limits."""
    if head.join is None:
        raise ValueError("only a joinable request heads a joined batch")
    batch, tokens = [head], head.join.tokens
    for task in others:
        if len(batch) >= limits.max_join_requests:
            break
        join = task.join
        if join is None or task.quanta is not None or not can_join(head.join, join):
            continue
        if tokens + join.tokens > limits.max_join_tokens:
            continue
        batch.append(task)
        tokens += join.tokens
    return batch


# a server whose compute thread was busy this share of the last BUSY_WINDOW_S is behind the others of its chain:
# it batches all the decode steps it has, cohorts or not (one forward for many costs little more than for a few)
SATURATED_SHARE = 0.9
BUSY_WINDOW_S = 1.0
# a batch waiting for a due session's step waits this much past the step's expected time (jitter)
_DUE_SLACK_S = 0.005


@dataclass(eq=False)
class _Rhythm:
    """When a session's decode steps arrive: the last one, and the smoothed interval between them."""

    key: tuple[int, int, str | None, bool]  # DecodeStep.key of its steps
    last_s: float
    interval_s: float | None = None

    def arrived(self, now: float) -> None:
        gap = now - self.last_s
        self.interval_s = gap if self.interval_s is None else 0.7 * self.interval_s + 0.3 * gap
        self.last_s = now

    @property
    def next_s(self) -> float:
        return self.last_s + (self.interval_s or 0.0)

    def expected(self, now: float, by: float, active_s: float) -> bool:
        """Whether its next step is due by `by` and not overdue yet (it stepped within active_s and keeps a known
        rhythm): a session late beyond a little jitter is not waited for."""
        if self.interval_s is None or now - self.last_s > active_s:
            return False
        return now < self.next_s + _DUE_SLACK_S and self.next_s <= by


# what _advance returns when a long task has run one quantum and has more to run
_UNFINISHED: Any = object()


class Scheduler:
    """Queues requests from the handlers (on the event loop) and runs them on `executor` (one thread), one batch at a
    time: a lone task by its own `run`, several decode steps (or prompts) by `run_decodes` (a result per step, in
    order)."""

    def __init__(
        self, executor: Executor, run_decodes: Callable[[list[DecodeStep]], list[Any]], limits: BatchLimits,
        run_joined: Callable[[list[JoinableRequest]], Any] | None = None,
    ):  # fmt: skip
        """run_joined runs joinable requests as one (like a lone task's run: a result per request, or a generator
        returning them); without it, requests are never joined."""
        self.executor, self.run_decodes, self.limits = executor, run_decodes, limits
        self.run_joined = run_joined
        self.queue: list[Task] = []
        self.last_served: dict[str, int] = {}
        self._arrivals = 0
        self._turns = 0
        self._runner: asyncio.Task[None] | None = None
        self.batched_steps = 0  # forwards that ran decode steps of more than one session
        self.batched_sessions = 0  # session steps that ran in those forwards
        self.max_sessions_per_step = 1  # most sessions in one forward so far
        self.joined_prompts = 0  # forwards that ran the prompts of more than one fresh session
        self.joined_prompt_sessions = 0  # prompts that ran in those forwards
        self.joined_runs = 0  # forward/backward computations that ran requests of more than one caller
        self.joined_requests = 0  # requests that ran in those computations
        self.depth = DepthMeter()  # turns a new request waits for, averaged over time (announced in the record)
        self._rhythms: dict[int, _Rhythm] = {}  # decode steps' timing of each session, by its cache's id
        self._arrived = asyncio.Event()
        self._busy: deque[tuple[float, float]] = deque()  # (start, end) of the compute thread's recent runs

    def queue_depth(self) -> float:
        """The averaged turns of the compute thread a request arriving now waits for (0: idle)."""
        return self.depth.value(time.monotonic())

    def _measure(self) -> None:
        now = time.monotonic()
        self.depth.set(turns_ahead(self.queue, self.limits.max_sessions), now)

    async def submit(
        self, kind: Kind, peer: str, run: Callable[[], Any], decode: DecodeStep | None = None,
        join: JoinableRequest | None = None,
    ) -> Any:  # fmt: skip
        """Queue a request and wait for its result (or its exception)."""
        loop = asyncio.get_running_loop()
        self._arrivals += 1
        future: asyncio.Future[Any] = loop.create_future()
        task = Task(kind, peer, self._arrivals, run, decode, join if self.run_joined else None, future)
        task.arrived = time.monotonic()
        if decode is not None and not decode.prompt:  # a session's rhythm is that of its decode steps
            self._track(decode, task.arrived)
        self.queue.append(task)
        self._arrived.set()
        self._measure()
        if self._runner is None or self._runner.done():
            # runs while there is work: what arrives meanwhile waits, and is batched when the thread is free
            self._runner = loop.create_task(self._drain())
        try:
            return await future
        finally:
            if task in self.queue:  # the caller gave up before its turn
                self.queue.remove(task)
                self._measure()

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self.queue:
            batch = next_batch(self.queue, self.limits, self.last_served)
            cohort = self._cohort(batch)
            if batch and batch[0].decode is not None:
                if batch[0].decode.prompt:
                    for task in batch[cohort:]:
                        task.group = cohort  # the rest of this wave runs in groups of the same size
                batch = batch[:cohort]  # the rest runs next, as the next cohort
            if await self._wait_for_more(batch, cohort):
                continue
            for task in batch:
                self.queue.remove(task)
            batch = [task for task in batch if _wanted(task)]
            if not batch:
                continue
            if len(batch) > 1 and batch[0].join is not None:
                batch = [self._merge(batch, loop)]
            self._served(batch)
            self._measure()
            began = time.monotonic()
            try:
                results = await loop.run_in_executor(self.executor, self._execute, batch)
            except BaseException as e:  # noqa: BLE001 - every waiting caller gets the failure, then the loop goes on
                cancelled = isinstance(e, asyncio.CancelledError)
                for task in batch:
                    if task.future is not None and not task.future.done():
                        task.future.cancel() if cancelled else task.future.set_exception(e)
                if cancelled:
                    raise
                continue
            finally:
                self._busy.append((began, time.monotonic()))
            if results is _UNFINISHED:
                self.queue.append(batch[0])  # its next quantum waits for its turn like any other task
                continue
            for task, result in zip(batch, results, strict=True):
                if task.future is not None and not task.future.done():
                    task.future.set_result(result)

    def forget(self, cache: DynamicCache) -> None:
        """The session owning `cache` ended: no batch waits for its steps any more."""
        self._rhythms.pop(id(cache), None)

    def _track(self, step: DecodeStep, now: float) -> None:
        """Note the arrival of a session's decode step (its rhythm predicts the next one)."""
        rhythm = self._rhythms.get(id(step.cache))
        if rhythm is None:
            if len(self._rhythms) >= MAX_REMEMBERED_PEERS:  # bounded: the stalest go first
                stalest = sorted(self._rhythms, key=lambda c: self._rhythms[c].last_s)
                for cache_id in stalest[: len(stalest) // 2]:
                    del self._rhythms[cache_id]
            self._rhythms[id(step.cache)] = _Rhythm(step.key, now)
        else:
            rhythm.arrived(now)

    def busy_share(self, now: float | None = None) -> float:
        """The share of the last BUSY_WINDOW_S the compute thread spent running batches."""
        now = time.monotonic() if now is None else now
        since = now - BUSY_WINDOW_S
        while self._busy and self._busy[0][1] <= since:
            self._busy.popleft()
        return sum(end - max(start, since) for start, end in self._busy) / BUSY_WINDOW_S

    def _cohort(self, batch: list[Task]) -> int:
        """The most sessions a decode batch like `batch` holds and waits for: a cohort of the sessions active over
        its blocks (BatchLimits.stages), unless this server is behind. Prompts waiting together split likewise when
        servers come after this one (BatchLimits.later_stages): the next one starts on the first group while this
        one computes the next, where one forward of all of them would keep it idle until that ended (on a CPU a
        joined prompt costs nearly what it costs alone, so joining them all saves little)."""
        head = batch[0].decode if batch else None
        if head is None or self.busy_share() >= SATURATED_SHARE:
            return self.limits.max_sessions
        if head.prompt:
            if batch[0].group:
                return batch[0].group
            groups = 1 + self.limits.later_stages
            sessions = sum(1 for task in self.queue if task.decode is not None and task.decode.key == head.key)
        else:
            now = time.monotonic()
            groups = self.limits.stages
            sessions = sum(
                1 for r in self._rhythms.values() if r.key == head.key and now - r.last_s <= self.limits.active_s
            )  # fmt: skip
        if groups <= 1:
            return self.limits.max_sessions
        return max(1, min(self.limits.max_sessions, -(-sessions // groups)))

    async def _wait_for_more(self, batch: list[Task], cohort: int) -> bool:
        """Whether a decode batch waited for the steps of other sessions over the same blocks that are due within
        the wait (they stepped recently and their next step is expected by then, from their own rhythm): one forward
        for all costs little more than one for a few, so concurrent sessions fall into step and share forwards. A
        session whose next step is not expected that soon (a slow link, a pause) is never waited for."""
        head = batch[0].decode if batch else None
        if head is None or head.prompt or self.limits.decode_wait_s <= 0 or len(batch) >= cohort:
            return False
        if any(task.decode is None or task.decode.prompt for task in self.queue):
            return False  # other work waits too: run what is here
        now = time.monotonic()
        deadline = min(task.arrived for task in batch) + self.limits.decode_wait_s
        if now >= deadline:
            return False
        present = {id(task.decode.cache) for task in batch if task.decode is not None}
        others = (r for cache_id, r in self._rhythms.items() if r.key == head.key and cache_id not in present)
        due = sorted(r.next_s for r in others if r.expected(now, deadline, self.limits.active_s))
        due = due[: cohort - len(batch)]  # the earliest, up to a full cohort
        if not due:
            return False
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), max(0.0, min(deadline, max(due) + _DUE_SLACK_S) - now))
        except TimeoutError:
            pass
        return True

    def _merge(self, batch: list[Task], loop: asyncio.AbstractEventLoop) -> Task:
        """One task running the joined requests of `batch`; its result (a list, one per request) goes to theirs."""
        if self.run_joined is None:
            raise RuntimeError("requests are joined only with run_joined")
        run_joined, joins = self.run_joined, [task.join for task in batch if task.join is not None]
        head = batch[0]
        merged = Task(head.kind, head.peer, head.seq, lambda: run_joined(joins), future=loop.create_future())
        merged.members = batch

        def hand_out(done: asyncio.Future[Any]) -> None:
            for index, task in enumerate(batch):
                if task.future is None or task.future.done():
                    continue
                if done.cancelled():
                    task.future.cancel()
                elif done.exception() is not None:
                    task.future.set_exception(cast(BaseException, done.exception()))
                else:
                    task.future.set_result(done.result()[index])

        if merged.future is not None:
            merged.future.add_done_callback(hand_out)
        self.joined_runs += 1
        self.joined_requests += len(batch)
        return merged

    def _execute(self, batch: list[Task]) -> list[Any]:
        """On the compute thread."""
        if len(batch) == 1:
            return self._advance(batch[0])
        steps = [task.decode for task in batch if task.decode is not None]
        results = self.run_decodes(steps)
        if steps[0].prompt:
            self.joined_prompts += 1
            self.joined_prompt_sessions += len(steps)
            return results
        self.batched_steps += 1
        self.batched_sessions += len(steps)
        self.max_sessions_per_step = max(self.max_sessions_per_step, len(steps))
        return results

    @staticmethod
    def _advance(task: Task) -> Any:
        """Run a lone task, or the next quantum of a long one: [its result], or _UNFINISHED."""
        if task.quanta is None:
            result = task.run()
            if not inspect.isgenerator(result):
                return [result]
            task.quanta = cast(Generator[None, None, Any], result)
        try:
            next(task.quanta)
        except StopIteration as done:
            return [done.value]
        return _UNFINISHED

    def _served(self, batch: list[Task]) -> None:
        batch = [member for task in batch for member in (task.members or [task])]
        self._turns += 1
        for task in batch:
            self.last_served[task.peer] = self._turns
        if len(self.last_served) > MAX_REMEMBERED_PEERS:
            waiting = {task.peer for task in self.queue}
            for peer in sorted(self.last_served, key=self.last_served.__getitem__):
                if len(self.last_served) <= MAX_REMEMBERED_PEERS // 2:
                    break
                if peer not in waiting:
                    del self.last_served[peer]
