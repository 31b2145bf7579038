"""Accounting on a server of what each remote peer, each host and all of them hold (buffered request bytes, open
streams and sessions, cache tokens), with limits; a full pool is made room in by closing richer, idle holders
(server/fairness.py decides which)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

# LimitError and short live with the other errors (net/transport.py raises and cuts them too); the server's modules
# take them from here with the rest of the per-peer accounting
from swarmlm.errors import LimitError, short
from swarmlm.protocol.messages import ReplyHeader
from swarmlm.server.fairness import POOLS, Holding, host_of, pick_victims
from swarmlm.server.memory import MemoryReturn

__all__ = ["Holding", "LimitError", "PeerLedger", "PeerLimits", "PoolFull", "refusal", "short", "where"]

logger = logging.getLogger(__name__)

# default bound on the bytes all peers may have buffered: this many peers' worth
MEMORY_PEERS = 8
# default streams of one peer: one per session slot (a pushing server holds one per session) plus these
STREAM_SLACK = 64
# default streams of all peers: this many per session slot (a session, pushes to it, forwards and info calls)
STREAMS_PER_SESSION = 8


def refusal(error: BaseException, text: str | None = None) -> ReplyHeader:
    """The reply refusing a request: short text, and the error's kind of limit (busy / too_large) or bad_request."""
    return ReplyHeader(
        ok=False, error=short(text or str(error)), error_kind=getattr(error, "error_kind", "bad_request")
    )


def where(error: BaseException) -> str:
    """The traceback of `error` without its message (which a peer may have made huge), for the log."""
    return "".join(traceback.format_tb(error.__traceback__)).rstrip()


@dataclass(frozen=True)
class PeerLimits:
    memory_bytes: int  # bytes of requests one peer may have buffered on this server at once
    sessions_per_peer: int  # inference sessions one peer may hold open
    sessions_total: int  # inference sessions all peers together may hold open
    cache_share: float  # fraction of the KV-cache budget one peer may hold
    memory_total_bytes: int | None = None  # bytes all peers may have buffered (None: MEMORY_PEERS peers' worth)
    streams_per_peer: int | None = None  # streams one peer may hold open (None: one per session slot + STREAM_SLACK)
    streams_total: int | None = None  # streams all peers may hold open (None: STREAMS_PER_SESSION per session slot)
    host_share: float = 0.5  # fraction of each of those pools one host's peers may hold (at least one peer's)
    reclaim_idle_s: float = 2.0  # holders idle this long are closed first when a pool is full and a peer waits

    def __post_init__(self) -> None:
        if not 0 < self.host_share <= 1:
            raise ValueError(f"host_share is a fraction in (0, 1], not {self.host_share}")
        if self.reclaim_idle_s < 0:
            raise ValueError(f"reclaim_idle_s is at least 0, not {self.reclaim_idle_s}")
        for name in ("memory_total_bytes", "streams_per_peer", "streams_total"):
            if (getattr(self, name) or 1) < 1:
                raise ValueError(f"{name} is at least 1 (or None: derived), not {getattr(self, name)}")

    @property
    def memory_total(self) -> int:
        return self.memory_total_bytes or MEMORY_PEERS * self.memory_bytes

    @property
    def peer_streams(self) -> int:
        return self.streams_per_peer or self.sessions_total + STREAM_SLACK

    @property
    def total_streams(self) -> int:
        return self.streams_total or STREAMS_PER_SESSION * self.sessions_total

    def host_cap(self, per_peer: float, total: float) -> float:
        """What one host may hold of a pool of `total` where one peer may hold `per_peer`."""
        return max(per_peer, total * self.host_share)


class PoolFull(LimitError):
    """A host's share or the server's whole pool is full: room may be made by closing richer holders."""

    def __init__(self, message: str, pool: str, needed: int, host_only: bool):
        super().__init__(message, "busy")
        self.pool, self.needed, self.host_only = pool, needed, host_only


@dataclass
class _Usage:
    buffered_bytes: int = 0
    sessions: int = 0
    cache_tokens: int = 0
    streams: int = 0


class PeerLedger:
    """What each remote peer, each host and all of them hold on this server; lives on the server's event loop."""

    def __init__(self, limits: PeerLimits):
        self.limits = limits
        self._peers: defaultdict[str, _Usage] = defaultdict(_Usage)
        self._hosts: dict[str, str] = {}  # peer -> its host (from its first stream), while it holds anything
        self._by_host: defaultdict[str, _Usage] = defaultdict(_Usage)
        self.total = _Usage()
        self._holdings: set[Holding] = set()  # open streams and sessions, for choosing whom to close
        self._changed: list[asyncio.Future] = []  # woken whenever anything is released
        self.reclaimed = 0  # holders closed for peers that waited (stats)
        # what released buffers held goes back to the system (the ledger's bound must hold in RSS too)
        self.memory_return = MemoryReturn()

    def usage(self, peer: str) -> _Usage:
        return self._peers.get(peer, _Usage())

    def host(self, peer: str) -> str:
        """The host a peer's holdings count to (a peer never seen on a stream is its own host)."""
        return self._hosts.get(peer, peer)

    def host_usage(self, host: str) -> _Usage:
        return self._by_host.get(host, _Usage())

    @property
    def sessions(self) -> int:
        return self.total.sessions

    def _add(self, peer: str, name: str, delta: int) -> None:
        for usage in (self._peers[peer], self._by_host[self.host(peer)], self.total):
            setattr(usage, name, getattr(usage, name) + delta)
        if delta < 0:
            self._forget_if_idle(peer)
            self._wake()

    def _forget_if_idle(self, peer: str) -> None:
        if self._peers.get(peer) == _Usage():
            del self._peers[peer]
            host = self._hosts.pop(peer, peer)
            if self._by_host.get(host) == _Usage():
                del self._by_host[host]

    # --- waiting for room, and making it
    def _wake(self) -> None:
        changed, self._changed = self._changed, []
        for future in changed:
            if not future.done():
                future.set_result(None)

    async def _wait_change(self, timeout_s: float) -> None:
        changed = asyncio.get_running_loop().create_future()
        self._changed.append(changed)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed, max(0.0, timeout_s))

    def make_room(self, pool: str, peer: str, needed: int, host_only: bool) -> bool:
        """Close richer holders of `pool` (server/fairness.py) until `needed` of it is on its way back to `peer`;
        whether anything of that pool is on its way back."""
        loop = asyncio.get_running_loop()
        victims = pick_victims(self._holdings, pool, peer, self.host(peer), needed, host_only=host_only,
                               now=loop.time(), idle_s=self.limits.reclaim_idle_s)  # fmt: skip
        for victim in victims:
            logger.info("reclaiming a %s of peer=...%s host=%s (idle %.1f s) for peer=...%s", "session" if
                        victim.sessions else "stream", victim.peer[-6:], victim.host, victim.idle_s(loop.time()),
                        peer[-6:])  # fmt: skip
            victim.cutting = True
            self.reclaimed += 1
            victim.cut()
        return any(h.cutting and POOLS[pool](h) > 0 for h in self._holdings)

    async def _admit(self, check: Callable[[], None], peer: str, timeout_s: float) -> None:
        """Run `check` until it passes; while it finds a pool full, make room and wait (up to timeout_s)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                check()
                return
            except PoolFull as e:
                if not self.make_room(e.pool, peer, e.needed, e.host_only) or loop.time() >= deadline:
                    raise
            await self._wait_change(deadline - loop.time())

    def hold(self, holding: Holding) -> Holding:
        """Consider `holding` when making room (until dropped)."""
        self._holdings.add(holding)
        return holding

    def drop(self, holding: Holding | None) -> None:
        if holding is not None:
            self._holdings.discard(holding)

    # --- streams
    def open_stream(self, peer: str, address: str, cut: Callable[[], None]) -> Holding:
        """Count a new stream of `peer` from its remote multiaddr `address`. When its host or the server holds all the
        streams it may, the idle stream of a richer holder is closed for it; LimitError("busy") when none can be."""
        limits, host = self.limits, host_of(address)
        if self._peers[peer].streams >= limits.peer_streams:
            self._forget_if_idle(peer)
            raise LimitError(f"this peer already holds {limits.peer_streams} streams here", "busy")
        if peer not in self._hosts and self._peers[peer] == _Usage():
            self._hosts[peer] = host
        host = self.host(peer)
        holding = Holding(peer, host, cut, asyncio.get_running_loop().time(), streams=1)
        host_cap = limits.host_cap(limits.peer_streams, limits.total_streams)
        for full, host_only, text in (
            (lambda: self.host_usage(host).streams >= host_cap, True, f"its host holds {host_cap:.0f} streams here"),
            (lambda: self.total.streams >= limits.total_streams, False, f"{limits.total_streams} streams open"),
        ):
            if full() and not self._cut_streams(peer, host_only):
                self._forget_if_idle(peer)
                raise LimitError(f"server busy: {text}", "busy")
        self._add(peer, "streams", 1)
        return self.hold(holding)

    def _cut_streams(self, peer: str, host_only: bool) -> bool:
        """Close one idle stream of a richer holder at once; whether there was one."""
        before = {h for h in self._holdings if h.cutting}
        self.make_room("streams", peer, 1, host_only)
        cut = [h for h in self._holdings if h.cutting and h.streams and h not in before]
        for holding in cut:
            self.close_stream(holding)  # its task is cancelled: the stream is as good as closed
        return bool(cut)

    def close_stream(self, holding: object) -> None:
        if isinstance(holding, Holding) and holding in self._holdings:
            self.drop(holding)
            self._add(holding.peer, "streams", -1)

    # --- bytes
    async def acquire_bytes(self, peer: str, size: int, timeout_s: float) -> None:
        """Count `size` bytes as buffered for `peer`, waiting up to timeout_s for room: its own earlier requests to
        finish, or (when its host or the server is full) richer holders' idle streams to close."""
        if size > self.limits.memory_bytes:
            raise LimitError(
                f"a frame of {size} bytes exceeds this server's per-peer memory bound of {self.limits.memory_bytes}",
                "too_large",
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (full := self._bytes_full(peer, size)) is not None:
            if isinstance(full, PoolFull):
                self.make_room("bytes", peer, full.needed, full.host_only)
            if loop.time() >= deadline:
                raise full
            await self._wait_change(deadline - loop.time())
        self._add(peer, "buffered_bytes", size)
        self.memory_return.buffered(self.total.buffered_bytes)

    def _bytes_full(self, peer: str, size: int) -> LimitError | None:
        limits, held = self.limits, self.usage(peer).buffered_bytes
        if held + size > limits.memory_bytes:
            return LimitError(
                f"peer has {held} bytes of requests in flight; the bound is {limits.memory_bytes}", "busy"
            )
        host_held, total = self.host_usage(self.host(peer)).buffered_bytes, self.total.buffered_bytes
        host_cap = int(limits.host_cap(limits.memory_bytes, limits.memory_total))
        if host_held + size > host_cap:
            text = f"server busy: this host has {host_held} bytes of requests in flight; its bound is {host_cap}"
            return PoolFull(text, "bytes", host_held + size - host_cap, host_only=True)
        if total + size > limits.memory_total:
            text = f"server busy: {total} bytes of requests in flight; the bound is {limits.memory_total}"
            return PoolFull(text, "bytes", total + size - limits.memory_total, host_only=False)
        return None

    def release_bytes(self, peer: str, size: int) -> None:
        if size:
            self._add(peer, "buffered_bytes", -size)
            self.memory_return.released(size, self.total.buffered_bytes)

    # --- sessions
    def open_session(self, peer: str) -> None:
        """Count a new session of `peer`, or raise LimitError("busy") when a session cap is reached (PoolFull when it
        is its host's or the server's: room may be made)."""
        limits, host = self.limits, self.host(peer)
        if self.usage(peer).sessions >= limits.sessions_per_peer:
            raise LimitError(f"this peer already holds {limits.sessions_per_peer} sessions here", "busy")
        host_cap = int(limits.host_cap(limits.sessions_per_peer, limits.sessions_total))
        if self.host_usage(host).sessions >= host_cap:
            raise PoolFull(f"server busy: this peer's host holds {host_cap} sessions here", "sessions", 1, True)
        if self.total.sessions >= limits.sessions_total:
            raise PoolFull(f"server busy: {limits.sessions_total} inference sessions open", "sessions", 1, False)
        self._add(peer, "sessions", 1)

    async def admit_session(self, peer: str, timeout_s: float) -> None:
        """open_session, closing richer holders' idle sessions and waiting up to timeout_s when a pool is full."""
        await self._admit(lambda: self.open_session(peer), peer, timeout_s)

    def close_session(self, peer: str) -> None:
        self._add(peer, "sessions", -1)

    # --- cache
    def check_cache(self, peer: str, tokens: int, capacity: int) -> None:
        """Refuse a reservation that would take `peer` (or its host) beyond its share of a cache of `capacity`
        block-tokens (PoolFull for the host's share: room may be made)."""
        share = int(capacity * self.limits.cache_share)
        held = self.usage(peer).cache_tokens
        if share < capacity and held + tokens > share:  # a share of the whole cache: the budget alone decides
            kind = "too_large" if tokens > share else "busy"
            raise LimitError(
                f"a session of {tokens} cache block-tokens would take this peer to {held + tokens}, "
                f"beyond its share of {share} of {capacity}",
                kind,
            )
        host_share = int(self.limits.host_cap(share, capacity))
        host_held = self.host_usage(self.host(peer)).cache_tokens
        if host_share < capacity and host_held + tokens > host_share:
            text = (f"server busy: a session of {tokens} cache block-tokens would take this peer's host to "
                    f"{host_held + tokens}, beyond its share of {host_share} of {capacity}")  # fmt: skip
            raise PoolFull(text, "cache", host_held + tokens - host_share, host_only=True)

    async def admit_cache(self, peer: str, tokens: int, capacity: int, timeout_s: float) -> None:
        """check_cache, closing richer holders' idle sessions of the peer's host and waiting when its share is full."""
        await self._admit(lambda: self.check_cache(peer, tokens, capacity), peer, timeout_s)

    def add_cache(self, peer: str, tokens: int) -> None:
        self._add(peer, "cache_tokens", tokens)
        if tokens >= 0:
            self._forget_if_idle(peer)
