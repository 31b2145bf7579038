"""The event engine: a simulated clock and a queue of timed callbacks, run in time order (ties in scheduling order)."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(order=True)
class Event:
    """A callback due at `time`; `cancel()` keeps it from running."""

    time: float
    seq: int
    action: Callable[..., Any] = field(compare=False)
    args: tuple[Any, ...] = field(compare=False, default=())
    cancelled: bool = field(compare=False, default=False)

    def cancel(self) -> None:
        self.cancelled = True


class Engine:
    """Runs events in order of (time, order of scheduling); the clock jumps from one event to the next."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[Event] = []
        self._seq = 0
        self.processed = 0

    def at(self, time: float, action: Callable[..., Any], *args: Any) -> Event:
        """Run action(*args) at simulated time `time` (never before now)."""
        if time != time:  # NaN would break the heap's order silently
            raise ValueError("an event's time must be a number")
        event = Event(max(time, self.now), self._seq, action, args)
        self._seq += 1
        heapq.heappush(self._queue, event)
        return event

    def after(self, delay_s: float, action: Callable[..., Any], *args: Any) -> Event:
        """Run action(*args) delay_s simulated seconds from now."""
        if delay_s < 0:
            raise ValueError(f"cannot schedule {delay_s} s in the past")
        return self.at(self.now + delay_s, action, *args)

    def run(self, until: float, progress: Callable[[float], None] | None = None) -> None:
        """Run every event due up to `until`, then set the clock to `until`; progress(now) after each event."""
        queue = self._queue
        while queue and queue[0].time <= until:
            event = heapq.heappop(queue)
            if event.cancelled:
                continue
            self.now = event.time
            event.action(*event.args)
            self.processed += 1
            if progress is not None:
                progress(self.now)
        self.now = max(self.now, until)

    def pending(self) -> int:
        """Events still queued (cancelled ones included until their time comes)."""
        return len(self._queue)
