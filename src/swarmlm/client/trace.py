"""A client-side trace of one request: the servers it used, compute vs network time, retries, replays and checks.

A request (a forward, a backward, an inference step) runs on the client's loop inside `tracing()`, which makes a
RequestTrace current (a context variable: sub-batches and checks running as tasks share it); the span-call helper,
the retry policy, replays and spot checks add to the current trace, and the model keeps the last one finished as
`model.last_trace`. Compute time is what the server says it spent; network time is the rest of the call as
measured by this client (so a server that lies about its compute time only moves time between the two columns).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class CallTrace:
    """One call of a span on one server."""

    peer_id: str
    start: int  # first block of the call
    end: int  # one past its last block
    kind: str  # forward | backward | step | open | replay | check
    total_ms: float  # by the client's clock, from sending to the full reply
    compute_ms: float  # what the server says its compute took (0 for calls that ran nothing)

    @property
    def network_ms(self) -> float:
        return max(0.0, self.total_ms - self.compute_ms)


@dataclass(frozen=True)
class CheckTrace:
    """One spot check: a span's result from `peers` re-run on independent servers."""

    start: int
    end: int
    peers: tuple[str, ...]  # the servers whose result was checked
    reason: str  # why it was checked: "new server", "random", "reported", "norm out of bounds"
    outcome: str  # "agreed", "unchecked" (no independent server), "wrong: <peers>" (minority, banned), "unsettled"
    checkers: tuple[str, ...] = ()  # the servers that re-ran it


@dataclass
class RequestTrace:
    kind: str  # forward | backward | inference | generate (a whole generate() call)
    calls: list[CallTrace] = field(default_factory=list)
    checks: list[CheckTrace] = field(default_factory=list)
    retries: int = 0  # failed calls that were retried elsewhere
    replays: int = 0  # inference spans rebuilt on another server by replaying their history
    began: float = field(default_factory=time.perf_counter)
    total_ms: float = 0.0  # the whole request, set when it ends

    @property
    def servers(self) -> list[str]:
        """Servers called, in order of first use."""
        return list(dict.fromkeys(call.peer_id for call in self.calls))

    @property
    def compute_ms(self) -> float:
        return sum(call.compute_ms for call in self.calls)

    @property
    def network_ms(self) -> float:
        return sum(call.network_ms for call in self.calls)

    def add(self, other: RequestTrace) -> None:
        """Count `other` (a step of a generation) in this trace."""
        self.calls += other.calls
        self.checks += other.checks
        self.retries += other.retries
        self.replays += other.replays
        self.total_ms += other.total_ms

    def summary(self) -> str:
        """One line for logs and the user: servers, times, retries, replays and checks."""
        checks = ", ".join(f"{c.start}:{c.end} {c.outcome}" for c in self.checks) or "none"
        servers = " ".join(f"...{peer[-6:]}" for peer in self.servers)
        return (
            f"{self.kind}: {self.total_ms:.1f} ms ({self.compute_ms:.1f} compute, {self.network_ms:.1f} network) "
            f"servers [{servers}] retries {self.retries} replays {self.replays} checks {checks}"
        )


_CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("swarmlm_trace", default=None)
# why calls are made in this context when not for the request itself: "check" or "replay"
_PURPOSE: contextvars.ContextVar[str | None] = contextvars.ContextVar("swarmlm_call_purpose", default=None)


def current() -> RequestTrace | None:
    """The trace of the request running in this context, if any."""
    return _CURRENT.get()


async def traced(kind: str, coroutine: Coroutine[Any, Any, T], keep: Callable[[RequestTrace], None]) -> T:
    """Run a request (on the client's loop) with a new current trace, and hand the finished trace to `keep`
    (whether the request succeeded or failed)."""
    trace = RequestTrace(kind)
    token = _CURRENT.set(trace)
    try:
        return await coroutine
    finally:
        trace.total_ms = (time.perf_counter() - trace.began) * 1e3
        _CURRENT.reset(token)
        keep(trace)


@contextlib.contextmanager
def purpose(kind: str) -> Iterator[None]:
    """Calls made in the body are traced as `kind` ("check", "replay") instead of their message's kind."""
    token = _PURPOSE.set(kind)
    try:
        yield
    finally:
        _PURPOSE.reset(token)


def record_call(peer_id: str, start: int, end: int, kind: str, total_ms: float, compute_ms: float) -> None:
    trace = _CURRENT.get()
    if trace is not None:
        trace.calls.append(CallTrace(peer_id, start, end, _PURPOSE.get() or kind, total_ms, compute_ms))


def record_retry() -> None:
    trace = _CURRENT.get()
    if trace is not None:
        trace.retries += 1


def record_replay() -> None:
    trace = _CURRENT.get()
    if trace is not None:
        trace.replays += 1


def record_check(check: CheckTrace) -> None:
    trace = _CURRENT.get()
    if trace is not None:
        trace.checks.append(check)
