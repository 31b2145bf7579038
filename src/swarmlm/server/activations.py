"""Forward graphs a server keeps for the backward that follows, so that a training step computes its forward once.

A client's forward that will be differentiated asks the server to keep the graph (`keep`: an id the client drew);
the backward names it (`kept`) and runs from it when the server still holds it and the backward's inputs are exactly
the forward's, else recomputes the forward as without a cache. What is kept is bounded: a memory budget for all
peers, of which the peers of one host may hold `host_share`; a graph that does not fit evicts the oldest graphs
(of its own host first, when that host is over its share), and a graph not taken within `ttl_s` is dropped. A
graph larger than its host's share is not kept.

Only the span's compute thread changes the cache (the backend puts and takes within a computation's pieces), so it
needs no lock; the event loop only asks whether a graph is held (a dict lookup), to let a backward without one join
others.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from swarmlm.protocol.bundle import SpanTensors
from swarmlm.server.pieces import BlockGraph

# how long a kept graph waits for its backward (a training step's loss and backward take far less)
DEFAULT_TTL_S = 120.0


@dataclass(frozen=True)
class KeptKey:
    """Whose graph: the sender (a peer id) and the id it chose."""

    peer: str
    key: str


@dataclass(frozen=True)
class Kept:
    """A forward's graphs (one per block, in order) with what the forward was asked, to match its backward."""

    host: str
    start: int
    end: int
    adapter: str | None
    inputs: SpanTensors  # the forward's bundle as received (no grad_outputs)
    graphs: list[BlockGraph]
    nbytes: int  # memory the graphs hold (server.pieces.BlockGraph.nbytes)
    created: float

    def matches(self, start: int, end: int, adapter: str | None, inputs: SpanTensors) -> bool:
        """Whether a backward over [start, end) with `inputs` (grad_outputs aside) is this forward's."""
        if (start, end, adapter) != (self.start, self.end, self.adapter):
            return False
        for name in ("hidden", "attention_mask", "position_ids", "prompts", "lora"):
            if not _same(getattr(self.inputs, name), getattr(inputs, name)):
                return False
        return True


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


class ActivationCache:
    """Kept forward graphs by (peer, id), oldest first, within a budget of bytes (see the module's doc)."""

    def __init__(
        self, budget_bytes: int, host_share: float = 0.5, ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        if budget_bytes < 0 or not 0 < host_share <= 1 or ttl_s <= 0:
            raise ValueError(f"bad activation cache bounds: {budget_bytes} bytes, share {host_share}, ttl {ttl_s} s")
        self.budget, self.host_share, self.ttl_s, self.clock = budget_bytes, host_share, ttl_s, clock
        self._entries: OrderedDict[KeptKey, Kept] = OrderedDict()  # oldest first
        self.nbytes = 0
        self.hits = self.misses = self.evicted = self.refused = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def cap(self) -> int:
        """The most bytes of graphs one forward may keep: a host's share of the budget."""
        return int(self.budget * self.host_share)

    def holds(self, peer: str, key: str) -> bool:
        """Whether `peer`'s graph `key` is kept now (it may still be dropped before a take)."""
        return KeptKey(peer, key) in self._entries

    def host_bytes(self, host: str) -> int:
        return sum(kept.nbytes for kept in self._entries.values() if kept.host == host)

    def put(
        self, peer: str, key: str, host: str, start: int, end: int, adapter: str | None, inputs: SpanTensors,
        graphs: Sequence[BlockGraph],
    ) -> bool:  # fmt: skip
        """Keep a forward's graphs; False when they cannot fit (then nothing is kept). A key the peer used before
        is replaced."""
        self.expire()
        self._drop(KeptKey(peer, key))
        nbytes = sum(graph.nbytes for graph in graphs)
        host_cap = self.cap
        if nbytes > host_cap:
            self.refused += 1
            return False
        self._evict(lambda kept: kept.host == host, self.host_bytes(host) + nbytes - host_cap)
        self._evict(lambda kept: True, self.nbytes + nbytes - self.budget)
        now = self.clock()
        self._entries[KeptKey(peer, key)] = Kept(host, start, end, adapter, inputs, list(graphs), nbytes, now)
        self.nbytes += nbytes
        return True

    def take(
        self, peer: str, key: str, start: int, end: int, adapter: str | None, inputs: SpanTensors
    ) -> list[BlockGraph] | None:
        """The graphs `peer` kept under `key` if they are of exactly this backward's forward (they are dropped
        either way: a graph runs one backward), else None."""
        self.expire()
        kept = self._drop(KeptKey(peer, key))
        if kept is None or not kept.matches(start, end, adapter, inputs):
            self.misses += 1
            return None
        self.hits += 1
        return kept.graphs

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _drop(self, key: KeptKey) -> Kept | None:
        kept = self._entries.pop(key, None)
        if kept is not None:
            self.nbytes -= kept.nbytes
        return kept

    def _evict(self, whose: Callable[[Kept], bool], excess: int) -> None:
        """Drop the oldest entries `whose` until `excess` bytes are freed."""
        for key in [key for key, kept in self._entries.items() if whose(kept)]:
            if excess <= 0:
                return
            kept = self._drop(key)
            if kept is not None:
                excess -= kept.nbytes
                self.evicted += 1

    def expire(self) -> int:
        """Drop the graphs no backward took within ttl_s (the server also calls this while no request comes, so
        what forwards left behind is freed); how many."""
        dropped = 0
        deadline = self.clock() - self.ttl_s
        while self._entries:
            key, oldest = next(iter(self._entries.items()))
            if oldest.created > deadline:
                return dropped
            self._drop(key)
            self.evicted += 1
            dropped += 1
        return dropped
