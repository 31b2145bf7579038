"""Which announced servers this client uses, and the routing view of them (records + own measurements -> views).

A record is used only if it is online and serves the client's model (same fingerprint), speaks its protocol
version, computes in an accepted dtype and passes the allow/block lists. Rejections are logged once per server.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from swarmlm.client.health import Health
from swarmlm.errors import MissingAdapterError
from swarmlm.protocol.messages import PROTOCOL_VERSION
from swarmlm.swarm.records import ServerRecord, ServerState
from swarmlm.swarm.route_choice import lacks_room
from swarmlm.swarm.routing import DEFAULT_LATENCY_S, ServerView, bounded_priors

logger = logging.getLogger(__name__)

# an error naming the adapters held lists this many servers, and this many adapters of each (records are claims)
MAX_LISTED_SERVERS = 8
MAX_LISTED_ADAPTERS = 8
# load factor per announced open inference session: each interleaves its decode steps with every other request, so
# ten sessions count as doubling the server's cost (routing bounds the total at MAX_LOAD_FACTOR)
SESSION_LOAD = 0.1
# load factor per compute turn a new request waits for on the server (its announced queue depth): each turn ahead
# costs about what the request itself does there (a forward like ours, or one batched decode step)
QUEUE_LOAD = 1.0


def announced_load(record: ServerRecord) -> float:
    """The load factor routing adds to a server's cost from its announcement: the expected wait behind its queue
    and its open sessions, as a fraction of the request's own cost there (>= 0; routing bounds it)."""
    return load_of(record.sessions_open, record.queue_depth)


def load_of(sessions_open: int, queue_depth: float) -> float:
    """announced_load from the two announced figures (the simulator's servers announce them too)."""
    return SESSION_LOAD * sessions_open + QUEUE_LOAD * queue_depth


@dataclass(frozen=True)
class ServerFilter:
    """What this client accepts of a server."""

    fingerprint: str | None  # the model's fingerprint (None: any model under the prefix, for callers without one)
    accepted_dtypes: frozenset[str]  # compute dtypes accepted
    allowed: frozenset[str] | None = None  # only these peer ids (None: any)
    blocked: frozenset[str] = frozenset()  # never these peer ids
    protocol_version: int = PROTOCOL_VERSION  # the wire protocol this client speaks
    adapter: str | None = None  # a LoRA adapter the server must serve (None: any server)

    @classmethod
    def of(
        cls,
        fingerprint: str | None,
        accepted_dtypes: Iterable[str],
        allowed: Iterable[str] | None = None,
        blocked: Iterable[str] = (),
        adapter: str | None = None,
    ) -> ServerFilter:
        return cls(
            fingerprint,
            frozenset(accepted_dtypes),
            None if allowed is None else frozenset(allowed),
            frozenset(blocked),
            adapter=adapter,
        )

    def rejection(self, peer_id: str, record: ServerRecord) -> str | None:
        """Why this client does not use the server, or None if it does (an offline server is not "rejected")."""
        if peer_id in self.blocked:
            return "it is in blocked_servers"
        if self.allowed is not None and peer_id not in self.allowed:
            return "it is not in allowed_servers"
        if record.protocol_version != self.protocol_version:
            return f"it speaks protocol {record.protocol_version}, this client {self.protocol_version}"
        if self.fingerprint is not None and record.fingerprint != self.fingerprint:
            return f"it serves another model (fingerprint {record.fingerprint[:12] or 'none'!r})"
        if record.dtype not in self.accepted_dtypes:
            return f"its dtype {record.dtype!r} is not accepted"
        if self.adapter is not None and self.adapter not in record.adapters:
            return f"it does not serve the adapter {self.adapter!r}"
        return None

    def lacks_adapter(self, peer_id: str, record: ServerRecord) -> bool:
        """Whether the server would be used but for the adapter it does not hold."""
        if self.adapter is None or self.adapter in record.adapters:
            return False
        return replace(self, adapter=None).rejection(peer_id, record) is None


def _covers(records: Iterable[ServerRecord], block: int) -> bool:
    return any(r.start <= block < r.end for r in records)


def _holdings(peer_id: str, record: ServerRecord) -> str:
    """One server's blocks and adapters, for an error message (records are strangers' claims: the list is cut)."""
    names = ", ".join(record.adapters[:MAX_LISTED_ADAPTERS]) or "no adapters"
    more = len(record.adapters) - MAX_LISTED_ADAPTERS
    return f"...{peer_id[-6:]} (blocks {record.start}:{record.end}): {names}{f' and {more} more' if more > 0 else ''}"


class SwarmView:
    """The servers this client may route through, refreshed from the DHT's records."""

    def __init__(self, server_filter: ServerFilter):
        self.filter = server_filter
        self.servers: dict[str, ServerRecord] = {}  # usable online servers by peer id
        self.without_adapter: dict[str, ServerRecord] = {}  # online servers usable but for the client's adapter
        self._logged: dict[str, str] = {}  # peer -> last rejection reason logged (log each once)

    def update(self, records: Mapping[str, ServerRecord]) -> None:
        usable, without_adapter = {}, {}
        for peer_id, record in records.items():
            if record.state != ServerState.ONLINE:
                continue
            reason = self.filter.rejection(peer_id, record)
            if reason is None:
                usable[peer_id] = record
            elif self.filter.lacks_adapter(peer_id, record):
                without_adapter[peer_id] = record
            elif self._logged.get(peer_id) != reason:
                self._logged[peer_id] = reason
                logger.info("Not using server ...%s: %s", peer_id[-6:], reason)
        self.servers, self.without_adapter = usable, without_adapter

    def missing_adapter(self, start: int, end: int) -> MissingAdapterError | None:
        """The error for blocks of [start, end) that servers this client would use hold, but none with its adapter:
        no wait helps those (a ban or a busy server only delays blocks some server holds the adapter for)."""
        adapter = self.filter.adapter
        if adapter is None or not self.without_adapter:
            return None
        holding, lacking = self.servers.values(), self.without_adapter.values()
        blocks = [b for b in range(start, end) if _covers(lacking, b) and not _covers(holding, b)]
        if not blocks:
            return None
        held = sorted(
            (r.start, peer) for peer, r in self.without_adapter.items() if r.start <= blocks[-1] and r.end > blocks[0]
        )
        lines = [_holdings(peer, self.without_adapter[peer]) for _, peer in held[:MAX_LISTED_SERVERS]]
        if len(held) > MAX_LISTED_SERVERS:
            lines.append(f"{len(held) - MAX_LISTED_SERVERS} more servers")
        return MissingAdapterError(adapter, blocks, lines)

    def views(self, health: Health) -> list[ServerView]:
        """Routing views: this client's measurements where it has them, else the announced speed, bounded.

        What this client has not measured never outranks what it has: a server it never called counts as no faster
        than the slowest server it called, and no nearer than the farthest (announcements are anyone's claims, and
        fake ones cost nothing to make; a faster newcomer is found by exploration, then by its measured calls)."""
        peers = list(self.servers)
        priors = bounded_priors([self.servers[p].throughput for p in peers])
        known = {peer: health.measured(peer, prior) for peer, prior in zip(peers, priors, strict=True)}
        called = [measured for peer, measured in known.items() if measured is not None and health.has_measured(peer)]
        slowest = min((throughput for _, throughput in called), default=math.inf)
        farthest = max((latency for latency, _ in called), default=0.0)
        views = []
        for peer_id, prior in zip(peers, priors, strict=True):
            record, measured = self.servers[peer_id], known[peer_id]
            latency_s, throughput = (None, prior) if measured is None else measured
            if not health.has_measured(peer_id) and called:
                throughput = min(throughput, slowest)
                latency_s = max(DEFAULT_LATENCY_S if latency_s is None else latency_s, farthest)
            views.append(ServerView(peer_id, record.start, record.end, throughput, latency_s, announced_load(record),
                                    record.cache_tokens_left))  # fmt: skip
        return views

    def full_for(self, session_tokens: int, start: int, end: int) -> set[str]:
        """Servers whose announced free cache cannot hold a new session of `session_tokens` (batch x max_length)
        tokens at each block of [start, end) they hold (swarm/route_choice.py, lacks_room)."""
        return {
            peer
            for peer, record in self.servers.items()
            if lacks_room(
                ServerView(
                    peer, record.start, record.end, record.throughput, cache_tokens_left=record.cache_tokens_left
                ),
                session_tokens,
                start,
                end,
            )
        }
