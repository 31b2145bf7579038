"""The cache the API's sessions hold on the servers, shared between the API's users.

The servers see the API as one peer and let it hold a share of their cache (server/peers.py: --peer-cache-share of
it, 0.5 by default); without a bound per user, one user's long answers fill that share and every other user's session
is refused busy. So the API keeps a ledger of the session tokens (batch x length) its requests reserve, by user, within
a budget: the API's share of the servers' caches as they announce them, or --cache-budget-tokens.

A user's fair share is the budget divided among the users with requests holding or waiting for room. A user within
it (or holding nothing: its first session) is entitled: it gets room at once, and when the budget is full, room is
made by pausing requests of the users furthest above their share (the largest holder's largest session first). A
paused request closes its session and waits for room, then replays its tokens into a new one: its answer is
unchanged, only later. A user above its share still grows into room nobody entitled waits for (the cache is not left
idle), and otherwise waits. Decisions are a pure function of the holdings and the waiters, tested without sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from swarmlm.errors import SwarmError

# what one peer may hold of a server's cache, the servers' default --peer-cache-share (they do not announce theirs);
# a server with a smaller share refuses the API sooner, so an operator sets --cache-budget-tokens for such a swarm
SERVER_PEER_CACHE_SHARE = 0.5
# longest a request waits for room in the API's budget (every wait has a deadline): then a request that has not
# started gets a 503, one paused or growing ends its answer with finish_reason "length"
CACHE_WAIT_S = 60.0


class CacheBusyError(SwarmError):
    """No room came free in the API's cache budget in time."""


@dataclass(eq=False)
class Lease:
    """Room for one session of one request: `tokens` (batch x length) of the API's budget."""

    user: str
    tokens: int
    paused: bool = False  # asked to give its room back: its request closes its session at its next step


@dataclass(eq=False)
class _Waiter:
    user: str
    tokens: int
    granted: asyncio.Future[Lease] = field(repr=False)


@dataclass(frozen=True)
class Decision:
    grant: list[int]  # indexes of the waiters that get room now
    pause: list[int]  # indexes of the leases to pause, so that an entitled waiter gets room


def fair_share(budget: int, users: int) -> int:
    """Tokens one user may hold while `users` users have requests."""
    return budget // max(1, users)


def decide(leases: Sequence[tuple[str, int, bool]], waiting: Sequence[tuple[str, int]], budget: int) -> Decision:
    """Who gets room now, and whose sessions pause to make it. `leases`: (user, tokens, paused already) of the
    sessions held; `waiting`: (user, tokens) in arrival order.

    Waiters are served fewest-held first (arrival order among equals). One that fits the room left gets it; an entitled
    one that does not fit pauses leases of users above their share, the largest holder first (counting leases already
    paused, whose room is on its way back), and the waiters behind it wait for that room; others keep waiting."""
    users = {user for user, _, _ in leases} | {user for user, _ in waiting}
    share = fair_share(budget, len(users))
    held: Counter[str] = Counter()
    for user, tokens, _ in leases:
        held[user] += tokens
    total = sum(held.values())
    grant: list[int] = []
    for index in sorted(range(len(waiting)), key=lambda i: held[waiting[i][0]]):  # sorted() is stable: arrival order
        user, tokens = waiting[index]
        if total + tokens <= budget:
            grant.append(index)
            held[user] += tokens
            total += tokens
        elif held[user] == 0 or held[user] + tokens <= share:
            return Decision(grant, _to_pause(leases, user, total + tokens - budget, share))
    return Decision(grant, [])


def _to_pause(leases: Sequence[tuple[str, int, bool]], asker: str, needed: int, share: int) -> list[int]:
    """Leases of users other than `asker` above their share, whose room (with what paused ones give back) makes
    `needed`."""
    coming = sum(tokens for _, tokens, paused in leases if paused)
    held: Counter[str] = Counter()
    for user, tokens, paused in leases:
        if not paused:
            held[user] += tokens
    chosen: list[int] = []
    while coming < needed:
        candidates = [i for i, (user, _, paused) in enumerate(leases)
                      if not paused and i not in chosen and user != asker and held[user] > share]  # fmt: skip
        if not candidates:
            break
        victim = max(candidates, key=lambda i: (held[leases[i][0]], leases[i][1]))
        chosen.append(victim)
        user, tokens, _ = leases[victim]
        held[user] -= tokens
        coming += tokens
    return chosen


def swarm_budget(
    spans: Iterable[tuple[int, int, int]], num_blocks: int, share: float = SERVER_PEER_CACHE_SHARE
) -> int:
    """The session tokens one peer may hold on the swarm, from the servers' (start, end, cache block-tokens): at each
    block, the most one server of it lets the peer hold there (all the API's sessions may take the same route), and the
    least of that over the blocks. 0 when a block has no server announcing a cache."""
    room = [0] * num_blocks
    for start, end, total in spans:
        if end > start:
            per_token = int(total * share) // (end - start)  # session tokens of room, at each of its blocks
            for block in range(max(0, start), min(end, num_blocks)):
                room[block] = max(room[block], per_token)
    return min(room, default=0)


class CacheLedger:
    """The API's sessions' room by user within `budget()` tokens (None: unknown yet, so nothing is bounded); lives on
    the client's loop."""

    def __init__(self, budget: Callable[[], int | None], wait_s: float = CACHE_WAIT_S):
        self.budget, self.wait_s = budget, wait_s
        self.leases: list[Lease] = []
        self._waiting: list[_Waiter] = []  # in arrival order

    def held(self, user: str) -> int:
        return sum(lease.tokens for lease in self.leases if lease.user == user)

    @contextlib.asynccontextmanager
    async def lease(self, user: str, tokens: int) -> AsyncIterator[Lease]:
        """Room for a session of `tokens`, held until the block ends (see acquire)."""
        lease = await self.acquire(user, tokens)
        try:
            yield lease
        finally:
            self.release(lease)

    async def acquire(self, user: str, tokens: int) -> Lease:
        """Room for a session of `tokens`, once the policy grants it; CacheBusyError after wait_s."""
        waiter = _Waiter(user, tokens, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        self._decide()
        try:
            async with asyncio.timeout(self.wait_s):
                return await asyncio.shield(waiter.granted)
        except BaseException as e:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
                self._decide()  # the head of the line left: those behind it may fit now
            elif waiter.granted.done() and not waiter.granted.cancelled():
                self.release(waiter.granted.result())  # granted as the wait ended: give the room on
            if isinstance(e, TimeoutError):
                raise CacheBusyError(f"no room in the API's cache budget came free in {self.wait_s:.0f} s "
                                     f"({self.held(user)} tokens held by this user)") from e  # fmt: skip
            raise

    def release(self, lease: Lease) -> None:
        """Give a lease's room back (its session is closed)."""
        if lease in self.leases:
            self.leases.remove(lease)
            self._decide()

    def _decide(self) -> None:
        budget = self.budget()
        waiting = [(w.user, w.tokens) for w in self._waiting]
        if budget is None:  # the servers' caches are not known yet: grant everything, as the servers will judge
            decision = Decision(list(range(len(waiting))), [])
        else:
            decision = decide([(lease.user, lease.tokens, lease.paused) for lease in self.leases], waiting, budget)
        for index in decision.pause:
            self.leases[index].paused = True
        granted = [self._waiting[index] for index in decision.grant]
        for waiter in granted:
            self._waiting.remove(waiter)
            lease = Lease(waiter.user, waiter.tokens)
            self.leases.append(lease)
            waiter.granted.set_result(lease)
