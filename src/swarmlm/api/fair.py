"""The API's generation slots shared fairly between its users (an API key, else the client's address): one user's
flood of requests must not keep every other user waiting. A pure queue discipline on the client's loop, tested
without sockets.

A free slot goes to the waiting user holding the fewest slots (the earliest request first among equals), and one user
holds at most `share` of them while anyone else waits or generates, so others always find room within one of their
own requests' time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

# the most of the slots one user holds while another user has requests (the rest stay for the others)
USER_SHARE = 0.75


@dataclass(eq=False)
class _Waiter:
    user: str
    granted: asyncio.Future[None]


class FairSlots:
    """`total` slots; `hold(user)` waits for one as the module's doc says."""

    def __init__(self, total: int, share: float = USER_SHARE):
        if total < 1 or not 0 < share <= 1:
            raise ValueError(f"bad slots: {total} total, a user's share {share}")
        self.total, self.share = total, share
        self.held: Counter[str] = Counter()  # slots each user holds
        self._waiting: list[_Waiter] = []  # in arrival order

    @property
    def cap(self) -> int:
        """The most slots one user holds while another user has requests: at least one."""
        return max(1, math.floor(self.total * self.share))

    @contextlib.asynccontextmanager
    async def hold(self, user: str) -> AsyncIterator[None]:
        waiter = _Waiter(user, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        self._grant()
        try:
            await waiter.granted
        except BaseException:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
            elif waiter.granted.done() and not waiter.granted.cancelled():
                self._release(user)  # granted as it was cancelled: give the slot on
            raise
        try:
            yield
        finally:
            self._release(user)

    def _release(self, user: str) -> None:
        self.held[user] -= 1
        if self.held[user] <= 0:
            del self.held[user]
        self._grant()

    def _grant(self) -> None:
        # a waiter whose wait was cancelled (its future done) has not run its cleanup yet: never grant it
        self._waiting = [waiter for waiter in self._waiting if not waiter.granted.done()]
        while self._waiting and sum(self.held.values()) < self.total:
            others = {waiter.user for waiter in self._waiting} | set(self.held)
            allowed = [w for w in self._waiting if len(others - {w.user}) == 0 or self.held[w.user] < self.cap]
            if not allowed:
                return
            chosen = min(allowed, key=lambda w: self.held[w.user])  # min keeps arrival order among equals
            self._waiting.remove(chosen)
            self.held[chosen.user] += 1
            chosen.granted.set_result(None)
