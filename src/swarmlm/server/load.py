"""How busy a server is: the turns of the compute thread a request arriving now would wait for, averaged over time."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

# the announced queue depth averages the last this many seconds (about a record refresh: a burst between two
# announcements still shows, and one long request does not pin the figure for minutes)
DEPTH_TIME_CONSTANT_S = 10.0


class _Queued(Protocol):
    @property
    def decode(self) -> object | None: ...


def turns_ahead(queue: Sequence[_Queued], max_sessions: int) -> int:
    """Turns of the compute thread waiting ahead of a request arriving now: one per queued forward, backward or lone
    inference step; decode steps share a turn (up to max_sessions per batch). The work running now is not counted:
    a server busy with one client's requests one after another has no queue, and must not look busy to that client."""
    decodes = sum(1 for task in queue if task.decode is not None)
    return (len(queue) - decodes) + math.ceil(decodes / max(1, max_sessions))


class DepthMeter:
    """A time-weighted exponential average of the queue depth: set() at every change, value() at any time."""

    def __init__(self, time_constant_s: float = DEPTH_TIME_CONSTANT_S):
        self.time_constant_s = time_constant_s
        self._average, self._current, self._since = 0.0, 0.0, 0.0

    def _decayed(self, now: float) -> float:
        """The average at `now`: the current depth held since the last change pulls it towards itself."""
        if now <= self._since:
            return self._average
        keep = math.exp(-(now - self._since) / self.time_constant_s)
        return self._current + (self._average - self._current) * keep

    def set(self, depth: float, now: float) -> None:
        self._average, self._current, self._since = self._decayed(now), depth, max(now, self._since)

    def value(self, now: float) -> float:
        return self._decayed(now)
