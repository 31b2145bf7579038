"""Per-peer accounting on a server: bytes buffered, open sessions and cache tokens of each remote peer, with limits."""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections import defaultdict
from dataclasses import dataclass

# LimitError and short live with the other errors (net/transport.py raises and cuts them too); the server's modules
# take them from here with the rest of the per-peer accounting
from swarmlm.errors import LimitError, short
from swarmlm.protocol.messages import ReplyHeader

__all__ = ["LimitError", "PeerLedger", "PeerLimits", "refusal", "short", "where"]


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


@dataclass
class _Peer:
    buffered_bytes: int = 0
    sessions: int = 0
    cache_tokens: int = 0


class PeerLedger:
    """What each remote peer holds on this server; lives on the server's event loop."""

    def __init__(self, limits: PeerLimits):
        self.limits = limits
        self._peers: defaultdict[str, _Peer] = defaultdict(_Peer)
        self._waiters: defaultdict[str, list[asyncio.Future]] = defaultdict(list)  # woken when the peer frees bytes

    def usage(self, peer: str) -> _Peer:
        return self._peers.get(peer, _Peer())

    @property
    def sessions(self) -> int:
        return sum(p.sessions for p in self._peers.values())

    async def acquire_bytes(self, peer: str, size: int, timeout_s: float) -> None:
        """Count `size` bytes as buffered for `peer`, waiting up to timeout_s for its earlier requests to finish."""
        if size > self.limits.memory_bytes:
            raise LimitError(
                f"a frame of {size} bytes exceeds this server's per-peer memory bound of {self.limits.memory_bytes}",
                "too_large",
            )
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._peers[peer].buffered_bytes + size > self.limits.memory_bytes:
            freed = asyncio.get_running_loop().create_future()
            self._waiters[peer].append(freed)
            try:
                await asyncio.wait_for(freed, max(0.0, deadline - asyncio.get_running_loop().time()))
            except TimeoutError as e:
                raise LimitError(
                    f"peer has {self._peers[peer].buffered_bytes} bytes of requests in flight; "
                    f"the bound is {self.limits.memory_bytes}",
                    "busy",
                ) from e
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters[peer].remove(freed)
                if not self._waiters[peer]:
                    del self._waiters[peer]
        self._peers[peer].buffered_bytes += size

    def release_bytes(self, peer: str, size: int) -> None:
        if size:
            self._peers[peer].buffered_bytes -= size
            self._forget_if_idle(peer)
            for freed in self._waiters.get(peer, ()):
                if not freed.done():
                    freed.set_result(None)

    def open_session(self, peer: str) -> None:
        """Count a new session of `peer`, or raise LimitError("busy") when a session cap is reached."""
        if self.sessions >= self.limits.sessions_total:
            raise LimitError(f"server busy: {self.limits.sessions_total} inference sessions open", "busy")
        if self._peers[peer].sessions >= self.limits.sessions_per_peer:
            raise LimitError(f"this peer already holds {self.limits.sessions_per_peer} sessions here", "busy")
        self._peers[peer].sessions += 1

    def close_session(self, peer: str) -> None:
        self._peers[peer].sessions -= 1
        self._forget_if_idle(peer)

    def check_cache(self, peer: str, tokens: int, capacity: int) -> None:
        """Refuse a reservation that would take `peer` beyond its share of a cache of `capacity` block-tokens."""
        share = int(capacity * self.limits.cache_share)
        held = self._peers[peer].cache_tokens
        if share < capacity and held + tokens > share:  # a share of the whole cache: the budget alone decides
            kind = "too_large" if tokens > share else "busy"
            raise LimitError(
                f"a session of {tokens} cache block-tokens would take this peer to {held + tokens}, "
                f"beyond its share of {share} of {capacity}",
                kind,
            )

    def add_cache(self, peer: str, tokens: int) -> None:
        self._peers[peer].cache_tokens += tokens
        self._forget_if_idle(peer)

    def _forget_if_idle(self, peer: str) -> None:
        entry = self._peers.get(peer)
        if entry is not None and entry == _Peer():
            del self._peers[peer]
