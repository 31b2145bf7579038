"""Placement rules the simulator compares: this project's (server/placement.py, called as the server calls it),
Petals' (as its block_selection.py describes it, written here from that description) and random spans."""

from __future__ import annotations

import random
from collections.abc import Mapping

from swarmlm.server.placement import SERVING, block_throughputs, bottleneck, choose_span, should_move, weakest_start
from swarmlm.swarm.records import ServerRecord

Span = tuple[int, int]
# Petals subtracts a server's own throughput times (1 + EPS) before choosing, which keeps near-ties in place
EPS = 1e-3
# Petals re-places every server greedily until none moves; the simulator stops after this many rounds
PETALS_MAX_ROUNDS = 4


class Rule:
    """Where a joining server goes, and whether a serving one moves (None: it stays)."""

    name = "base"
    check_interval_s: float | None = None  # None: the scenario's rebalance interval

    def join(self, num_blocks: int, n: int, records: Mapping[str, ServerRecord], me: str) -> Span:
        raise NotImplementedError

    def move(self, num_blocks: int, me: str, records: Mapping[str, ServerRecord], totals: list[float]) -> Span | None:
        """totals: block_throughputs of `records` (computed once per change of the swarm, shared by all checks)."""
        raise NotImplementedError


class SwarmlmRule(Rule):
    """choose_span on joining; should_move at each check."""

    name = "swarmlm"

    def __init__(self, quality: float):
        self.quality = quality

    def join(self, num_blocks: int, n: int, records: Mapping[str, ServerRecord], me: str) -> Span:
        return choose_span(num_blocks, n, records, me=me)

    def move(self, num_blocks: int, me: str, records: Mapping[str, ServerRecord], totals: list[float]) -> Span | None:
        mine = records[me]
        # should_move moves only when bottleneck(now) < quality * bottleneck(after), and the bottleneck after a
        # move is at most bottleneck(now) + mine.throughput: when even that fails, it would answer None (exact,
        # with a margin for rounding; tests/unit/test_sim_rules.py checks it against should_move)
        now = bottleneck(totals)
        if now > self.quality * (now + mine.throughput) * (1 + 1e-9):
            return None
        return should_move(num_blocks, me, records, self.quality)


class PetalsRule(Rule):
    """Petals: join where the swarm is weakest (its start rule is weakest_start's); at each check, simulate every
    server re-placing itself greedily after this one moves, and move if the swarm's weakest block would then be
    more than 1 / balance_quality times stronger; never move when that leaves a block uncovered."""

    name = "petals"
    check_interval_s = 120.0

    def __init__(self, quality: float, rng: random.Random):
        self.quality, self.rng = quality, rng

    def join(self, num_blocks: int, n: int, records: Mapping[str, ServerRecord], me: str) -> Span:
        return choose_span(num_blocks, n, records, me=me)

    def move(self, num_blocks: int, me: str, records: Mapping[str, ServerRecord], totals: list[float]) -> Span | None:
        mine = records[me]
        initial = min(totals)
        # moves keep the sum of throughputs, so the weakest block after any re-placement is at most the mean one
        if initial >= (self.quality - EPS) * (sum(totals) / len(totals)):
            return None
        others = list(totals)
        for b in range(mine.start, mine.end):
            others[b] -= mine.throughput * (1 + EPS)
        if initial > EPS and min(others) <= 0:
            return None
        n = mine.end - mine.start
        start = weakest_start(others, n)
        if start == mine.start:
            return None
        new = self._settled(num_blocks, me, records, others, start)
        if new < initial or new < EPS:
            return None
        return (start, start + n) if initial / new < self.quality - EPS else None

    def _settled(self, num_blocks: int, me: str, records: Mapping[str, ServerRecord], others: list[float],
                 start: int) -> float:  # fmt: skip
        """The weakest block once this server sits at `start` and every server re-placed itself greedily."""
        serving = [(peer, r) for peer, r in sorted(records.items()) if r.state in SERVING and r.end <= num_blocks]
        starts = {peer: r.start for peer, r in serving}
        sizes = {peer: (r.end - r.start, r.throughput) for peer, r in serving}
        totals = list(others)
        n, t = sizes[me]
        for b in range(starts[me], starts[me] + n):
            totals[b] += t * EPS
        starts[me] = start
        for b in range(start, start + n):
            totals[b] += t
        peers = list(starts)
        for _ in range(PETALS_MAX_ROUNDS):
            self.rng.shuffle(peers)
            moved = False
            for peer in peers:
                lo, (n, t) = starts[peer], sizes[peer]
                for b in range(lo, lo + n):
                    totals[b] -= t * (1 + EPS)
                new = weakest_start(totals, n)
                for b in range(lo, lo + n):
                    totals[b] += t * EPS
                for b in range(new, new + n):
                    totals[b] += t
                moved = moved or new != lo
                starts[peer] = new
            if not moved:
                break
        return min(totals)


class RandomRule(Rule):
    """A uniformly random span on joining; never moves."""

    name = "random"

    def __init__(self, rng: random.Random):
        self.rng = rng

    def join(self, num_blocks: int, n: int, records: Mapping[str, ServerRecord], me: str) -> Span:
        start = self.rng.randrange(num_blocks - n + 1)
        return start, start + n

    def move(self, num_blocks: int, me: str, records: Mapping[str, ServerRecord], totals: list[float]) -> Span | None:
        return None


def make_rule(name: str, quality: float, rng: random.Random) -> Rule:
    if name == "swarmlm":
        return SwarmlmRule(quality)
    if name == "petals":
        return PetalsRule(quality, rng)
    if name == "random":
        return RandomRule(rng)
    raise ValueError(f"unknown placement rule {name!r}")


def totals_of(num_blocks: int, records: Mapping[str, ServerRecord]) -> list[float]:
    """Per-block throughput of the serving records, as placement computes it."""
    return block_throughputs(num_blocks, records)
