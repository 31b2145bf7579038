"""Which holder a server closes when a pool (session slots, cache, buffered bytes, streams) is full and a peer waits:
a pure choice over holdings, tested without sockets.

Peer ids are free to make, so shares go to hosts (remote addresses) first and to peers within a host second. A waiting
peer may only take from someone richer than itself in that pool: a host that still holds at least as much as its own
host once it gave way, or a peer of its own host holding more than itself. Among those, holders idle for a while go
first, then those not in use, and live ones (a session between two steps of an answer) last; within each, the richest
host's, then its richest peer's, then the longest idle. A holder that is computing for its peer right now is never
taken.
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# IPv6 hosts are grouped by their /64 network: one machine gets a whole /64 as easily as one address
IPV6_HOST_PREFIX = 64
# a holder active this recently is live (a session between two decode steps sends its next one within this): it is
# taken only when nothing quieter can be
LIVE_S = 1.0


@dataclass(eq=False)
class Holding:
    """One stream or one inference session of a peer, and what it holds on this server."""

    peer: str  # full peer id
    host: str  # the peer's remote address, as host_of() names it
    cut: Callable[[], None]  # closes it (the stream is cancelled; the session ends with a busy reply at its next read)
    active_at: float  # loop time of its last request or reply
    busy: bool = False  # computing for its peer now: never cut
    cutting: bool = False  # cut already, its resources on their way back
    sessions: int = 0  # 1 for a session
    tokens: int = 0  # cache block-tokens of a session
    streams: int = 0  # 1 for a stream
    bytes: int = 0  # request bytes a stream has buffered

    def idle_s(self, now: float) -> float:
        return max(0.0, now - self.active_at)


Amount = Callable[[Holding], int]
POOLS: dict[str, Amount] = {
    "sessions": lambda h: h.sessions,
    "cache": lambda h: h.tokens,
    "streams": lambda h: h.streams,
    "bytes": lambda h: h.bytes,
}


def host_of(address: str) -> str:
    """The host a multiaddr comes from: its first IP (a relayed peer's is its relay's), an IPv6 one as its /64."""
    parts = address.split("/")
    for protocol, value in zip(parts, parts[1:], strict=False):
        if protocol == "ip4":
            return value
        if protocol == "ip6":
            try:
                return str(ipaddress.ip_network(f"{value}/{IPV6_HOST_PREFIX}", strict=False))
            except ValueError:
                return value
    return address or "unknown"


def _quietness(idle: float, idle_s: float) -> int:
    """0: idle for idle_s or more; 1: not in use (idle for LIVE_S); 2: live."""
    return 0 if idle >= idle_s else 1 if idle >= LIVE_S else 2


def pick_victims(
    holdings: Iterable[Holding], pool: str, asker_peer: str, asker_host: str, needed: int, *, host_only: bool,
    now: float, idle_s: float,
) -> list[Holding]:  # fmt: skip
    """The holdings to cut (the caller cuts them) so that `needed` of `pool` comes back: fewer, or none, when there
    are not enough richer ones. Holdings being cut already count towards `needed`. With host_only, only the asker's
    own host is taken from (that host is over its share)."""
    amount = POOLS[pool]
    held = [h for h in holdings if amount(h) > 0]
    coming = sum(amount(h) for h in held if h.cutting)
    by_host: defaultdict[str, int] = defaultdict(int)
    by_peer: defaultdict[str, int] = defaultdict(int)
    for h in held:
        if not h.cutting:
            by_host[h.host] += amount(h)
            by_peer[h.peer] += amount(h)

    def richer(h: Holding) -> bool:
        if h.host == asker_host:
            return by_peer[h.peer] > by_peer[asker_peer]
        # another host gives way only while it stays at least as rich as the asker's host once it has: taking the one
        # session of a host for a host holding none only swaps who waits (and makes the victim replay elsewhere), which
        # under overload would evict every admitted chat between its turns
        return not host_only and by_host[h.host] - amount(h) >= by_host[asker_host] + amount(h)

    victims: list[Holding] = []
    while coming < needed:
        candidates = [
            h for h in held if not (h.cutting or h.busy or h in victims) and h.peer != asker_peer and richer(h)
        ]
        if not candidates:
            break
        victim = min(candidates, key=lambda h: (_quietness(h.idle_s(now), idle_s), -by_host[h.host],
                                                -by_peer[h.peer], -h.idle_s(now)))  # fmt: skip
        victims.append(victim)  # the next victim is chosen among what is left
        coming += amount(victim)
        by_host[victim.host] -= amount(victim)
        by_peer[victim.peer] -= amount(victim)
    return victims
