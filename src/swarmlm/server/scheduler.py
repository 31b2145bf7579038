"""The server's scheduler: queues requests, asks `scheduling.schedule` what runs next, and runs it on the one compute
thread (the executor side: futures, generators, joined runs, counters)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Generator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, cast

from transformers.cache_utils import DynamicCache

from swarmlm.server.joining import JoinableRequest
from swarmlm.server.load import DepthMeter, turns_ahead
from swarmlm.server.scheduling import (
    BUSY_WINDOW_S,
    LONG_KINDS,
    MAX_REMEMBERED_PEERS,
    SATURATED_SHARE,
    BatchLimits,
    Decision,
    DecodeStep,
    Kind,
    SchedulerState,
    Task,
    busy_share,
    next_batch,
    schedule,
)

__all__ = [
    "BUSY_WINDOW_S", "MAX_REMEMBERED_PEERS", "SATURATED_SHARE", "BatchLimits", "DecodeStep", "Kind", "Scheduler",
    "Task", "Work", "next_batch",
]  # fmt: skip

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Work:
    """What the executor needs to run a task and answer its caller (the decisions never read it)."""

    # what to run, as data (server/backend.py: a SpanWork or a StepWork; of a joined task: its requests), so that a
    # request can be read from the wire to the backend and back
    item: Any
    # runs an item alone, on the compute thread: its reply, or a generator of quanta returning it (see below)
    execute: Callable[[Any], Any] = field(repr=False)
    future: asyncio.Future[Any] | None = field(default=None, repr=False)
    # a long request runs as a generator of quanta (server.pieces): it yields before each one and is sent its size in
    # tokens (0: a whole block); it goes back into the queue after each quantum, so more urgent work (inference
    # steps) and other peers' turns run in between; its return is the result
    quanta: Generator[None, int | None, Any] | None = field(default=None, repr=False)
    members: list[Task] | None = field(default=None, repr=False)  # of a joined task: the requests it runs

    def run(self) -> Any:
        """Run the item alone, on the compute thread."""
        return self.execute(self.item)


# what _advance returns when a long task has run one quantum and has more to run
_UNFINISHED: Any = object()


def _work(task: Task) -> Work:
    if task.work is None:
        raise RuntimeError(f"task {task.seq} of {task.peer} has nothing to run")
    return task.work


def _waited_for(task: Task) -> bool:
    """Whether the task's caller still waits for its result."""
    future = _work(task).future
    return future is not None and not future.done()


def _wanted(task: Task) -> bool:
    """Whether someone still waits for the task's result (for a joined task: any of its requests' callers)."""
    work = _work(task)
    if work.future is None or work.future.done():
        return False
    if work.members is not None and not any(_waited_for(member) for member in work.members):
        work.future.cancel()  # every caller gave up: its remaining blocks need not run
        return False
    return True


def _fail(batch: list[Task], error: BaseException) -> None:
    """Every caller still waiting for `batch` gets `error` (cancelled on a cancellation)."""
    for task in batch:
        future = _work(task).future
        if future is not None and not future.done():
            future.cancel() if isinstance(error, asyncio.CancelledError) else future.set_exception(error)


class Scheduler:
    """Queues requests from the handlers (on the event loop) and runs them on `executor` (one thread), one batch at a
    time, as `schedule` decides: a lone task's item by `execute`, several decode steps (or prompts) by `run_decodes` (a
    result per step, in order). `clock` is the time every timing rule reads (injected for tests)."""

    def __init__(
        self, executor: Executor, execute: Callable[[Any], Any], run_decodes: Callable[[list[DecodeStep]], list[Any]],
        limits: BatchLimits, run_joined: Callable[[list[JoinableRequest]], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        """execute runs a submitted item alone (its result, or a generator of quanta returning it); run_joined runs
        joinable requests as one (a result per request, or a generator returning them); without it, requests are
        never joined."""
        self.executor, self.execute, self.run_decodes, self.limits = executor, execute, run_decodes, limits
        self.run_joined, self.clock = run_joined, clock
        self.queue: list[Task] = []
        self.state = SchedulerState()
        self._arrivals = 0
        self._runner: asyncio.Task[None] | None = None
        self.batched_steps = 0  # forwards that ran decode steps of more than one session
        self.batched_sessions = 0  # session steps that ran in those forwards
        self.max_sessions_per_step = 1  # most sessions in one forward so far
        self.joined_prompts = 0  # forwards that ran the prompts of more than one fresh session
        self.joined_prompt_sessions = 0  # prompts that ran in those forwards
        self.joined_runs = 0  # forward/backward computations that ran requests of more than one caller
        self.joined_requests = 0  # requests that ran in those computations
        self.depth = DepthMeter()  # turns a new request waits for, averaged over time (announced in the record)
        self._arrived = asyncio.Event()
        # called (on the event loop) when an exclusive task has ended, answered, failed or dropped: what its graphs
        # held is free, and the server hands it back (server/memory.py)
        self.on_exclusive_done: Callable[[], None] | None = None

    @property
    def last_served(self) -> dict[str, int]:
        return self.state.last_served

    def queue_depth(self) -> float:
        """The averaged turns of the compute thread a request arriving now waits for (0: idle)."""
        return self.depth.value(self.clock())

    def busy_share(self) -> float:
        """The share of the last BUSY_WINDOW_S the compute thread spent running batches."""
        return busy_share(self.state, self.clock())

    def forget(self, cache: DynamicCache) -> None:
        """The session owning `cache` ended: no batch waits for its steps any more."""
        self.state.forget(cache)

    def _measure(self) -> None:
        self.depth.set(turns_ahead(self.queue, self.limits.max_sessions), self.clock())

    async def submit(
        self, kind: Kind, peer: str, item: Any, decode: DecodeStep | None = None, join: JoinableRequest | None = None,
        host: str = "", exclusive: bool = False,
    ) -> Any:  # fmt: skip
        """Queue a request of `peer` (of `host`: turns go round hosts first), `item` (what `execute` runs), and wait
        for its result (or its exception). exclusive: its memory grows as it runs (Task.exclusive)."""
        loop = asyncio.get_running_loop()
        self._arrivals += 1
        future: asyncio.Future[Any] = loop.create_future()
        join = join if self.run_joined else None
        work = Work(item, self.execute, future)
        task = Task(
            kind, peer, self._arrivals, decode, join, arrived=self.clock(), work=work, host=host, exclusive=exclusive
        )
        if decode is not None and not decode.prompt:  # a session's rhythm is that of its decode steps
            self.state.track(decode, task.arrived)
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
        while self.queue:
            decision = schedule(self.queue, self.state, self.limits, self.clock())
            if decision.wait_until is not None:
                await self._wait(decision.wait_until)
                continue
            batch = self._take(decision)
            if batch:
                await self._run(batch, decision.quantum)

    async def _wait(self, until: float) -> None:
        """Until `until` on the clock, or until a request arrives, whichever comes first."""
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), max(0.0, until - self.clock()))
        except TimeoutError:
            pass

    def _take(self, decision: Decision) -> list[Task]:
        """Take the decided batch out of the queue: its tasks still wanted, joined into one where they join."""
        for task in decision.regroup:
            task.group = decision.group  # the rest of this wave runs in groups of the same size
        for task in decision.batch:
            self.queue.remove(task)
        batch = [task for task in decision.batch if _wanted(task)]
        if any(task.exclusive and task.started and task not in batch for task in decision.batch):
            self._exclusive_done()  # a started computation nobody waits for any more is dropped with its graphs
        if len(batch) > 1 and batch[0].join is not None:
            batch = [self._merge(batch)]
        return batch

    async def _run(self, batch: list[Task], quantum: int = 0) -> None:
        """Run a batch on the compute thread and hand its results (or its failure) to its callers; a long task
        runs its next quantum, of `quantum` tokens (0: a whole block)."""
        loop = asyncio.get_running_loop()
        members = [member for task in batch for member in (_work(task).members or [task])]
        waiting = {task.peer for task in self.queue} | {task.host for task in self.queue}
        self.state.served(
            [task.peer for task in members], waiting, [task.host for task in members], long=batch[0].kind in LONG_KINDS
        )
        self._measure()
        began = self.clock()
        try:
            results = await loop.run_in_executor(self.executor, self._execute, batch, quantum)
        except BaseException as e:  # every waiting caller gets the failure, then the loop goes on
            _fail(batch, e)
            if batch[0].exclusive:
                self._exclusive_done()
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        finally:
            self.state.ran(began, self.clock())
        if results is _UNFINISHED:
            self.queue.append(batch[0])  # its next quantum waits for its turn like any other task
            return
        if batch[0].exclusive:
            self._exclusive_done()
        for task, result in zip(batch, results, strict=True):
            future = _work(task).future
            if future is not None and not future.done():
                future.set_result(result)

    def _exclusive_done(self) -> None:
        if self.on_exclusive_done is not None:
            self.on_exclusive_done()

    def _merge(self, batch: list[Task]) -> Task:
        """One task running the joined requests of `batch`; its result (a list, one per request) goes to theirs."""
        if self.run_joined is None:
            raise RuntimeError("requests are joined only with run_joined")
        joins, head = [task.join for task in batch if task.join is not None], batch[0]
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        joined = Work(joins, self.run_joined, future, members=batch)
        merged = Task(head.kind, head.peer, head.seq, work=joined, host=head.host, exclusive=head.exclusive)

        def hand_out(done: asyncio.Future[Any]) -> None:
            for index, task in enumerate(batch):
                member = _work(task).future
                if member is None or member.done():
                    continue
                if done.cancelled():
                    member.cancel()
                elif done.exception() is not None:
                    member.set_exception(cast(BaseException, done.exception()))
                else:
                    member.set_result(done.result()[index])

        future.add_done_callback(hand_out)
        self.joined_runs += 1
        self.joined_requests += len(batch)
        return merged

    def _execute(self, batch: list[Task], quantum: int) -> list[Any]:
        """On the compute thread."""
        if len(batch) == 1:
            return self._advance(batch[0], quantum)
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
    def _advance(task: Task, quantum: int) -> Any:
        """Run a lone task, or the next quantum (of `quantum` tokens) of a long one: [its result], or _UNFINISHED."""
        work = _work(task)
        try:
            if work.quanta is None:
                result = work.run()
                if not inspect.isgenerator(result):
                    return [result]
                work.quanta = cast(Generator[None, int | None, Any], result)
                task.started = True  # from now on it runs alone: it never joins others
                next(work.quanta)  # to the yield before its first quantum
            work.quanta.send(quantum)
        except StopIteration as done:
            return [done.value]
        return _UNFINISHED
