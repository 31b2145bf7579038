"""The client's view of the swarm: who serves which blocks, who is banned, and routes through them."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Collection

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarmlm.config import ClientConfig
from swarmlm.errors import MissingBlocksError
from swarmlm.swarm.dht import ParentBoundDHT, is_loopback_maddr, start_dht
from swarmlm.swarm.records import ServerRecord, ServerState, fetch_servers
from swarmlm.swarm.routing import RouteSpan, ServerView, find_route, missing_blocks

logger = logging.getLogger(__name__)

# weight of the newest sample in the exponential moving average of a server's round-trip time
LATENCY_EMA_WEIGHT = 0.3
# polling interval while waiting for missing blocks to be served
MISSING_BLOCKS_POLL_S = 0.5


class SequenceManager:
    """Owns the client's DHT node and P2P handle; lives on (and must be used from) the client's event loop."""

    def __init__(self, config: ClientConfig, dht_prefix: str, num_blocks: int):
        self.config, self.dht_prefix, self.num_blocks = config, dht_prefix, num_blocks
        self.dht: ParentBoundDHT | None = None
        self.p2p: P2P | None = None
        self.servers: dict[str, ServerRecord] = {}
        self._bans: dict[str, tuple[float, int]] = {}  # peer -> (banned until, consecutive failures)
        self._cool_downs: dict[str, float] = {}  # peer -> avoided until (busy: not a failure, never escalates)
        self._latency: dict[str, float] = {}  # peer -> smoothed round trip in seconds
        self._connected: set[str] = set()
        self._rng = random.Random()
        self._refresh_task: asyncio.Task | None = None

    async def start(self) -> None:
        peers = self.config.initial_peers
        host = "127.0.0.1" if peers and all(is_loopback_maddr(p) for p in peers) else "0.0.0.0"
        self.dht = await asyncio.to_thread(start_dht, peers, host=host, client_mode=True)
        self.p2p = await self.dht.replicate_p2p()
        await self.refresh()
        self._refresh_task = asyncio.create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
        if self.p2p is not None:
            await self.p2p.shutdown()
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)

    async def refresh(self) -> None:
        try:
            records = await fetch_servers(self.dht, self.dht_prefix)
        except Exception as e:  # noqa: BLE001 - a failed refresh keeps the previous view; the next one retries
            logger.warning("Reading the swarm from the DHT failed: %s", e)
            return
        self.servers = {peer: r for peer, r in records.items() if r.state == ServerState.ONLINE}

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.swarm_refresh_interval_s)
            await self.refresh()

    def _views(self) -> list[ServerView]:
        return [
            ServerView(peer, r.start, r.end, r.throughput, self._latency.get(peer)) for peer, r in self.servers.items()
        ]

    def _banned(self) -> set[str]:
        now = time.monotonic()
        banned = {peer for peer, (until, _) in self._bans.items() if until > now}
        return banned | {peer for peer, until in self._cool_downs.items() if until > now}

    def _excluded(self, tokens: int, avoid: Collection[str]) -> set[str]:
        """Servers a route for `tokens` tokens must not use: banned, cooling down, avoided, or announcing a
        smaller per-request limit."""
        too_small = {peer for peer in self.servers if (self.max_tokens_of(peer) or tokens) < tokens}
        return self._banned() | set(avoid) | too_small

    def max_tokens_of(self, peer_id: str) -> int | None:
        """The per-request token limit a server announces, if it announces one."""
        # read defensively: servers announce limits only from a newer record version on
        limit = getattr(self.servers.get(peer_id), "max_tokens_per_request", None)
        return limit if isinstance(limit, int) and limit > 0 else None

    def can_route(self, start: int, end: int, tokens: int = 1, avoid: Collection[str] = ()) -> bool:
        """Whether a route over [start, end) exists right now without the excluded servers (never waits)."""
        excluded = self._excluded(tokens, avoid)
        return find_route(self._views(), start, end, banned=excluded, tokens=tokens) is not None

    async def make_route(self, start: int, end: int, tokens: int = 1, avoid: Collection[str] = ()) -> list[RouteSpan]:
        """A route over blocks [start, end) for `tokens` tokens, without the servers in `avoid`; waits for missing
        blocks up to the configured timeout."""
        began = time.monotonic()
        while True:
            banned = self._excluded(tokens, avoid)
            route = find_route(self._views(), start, end, banned=banned, tokens=tokens, rng=self._rng)
            if route is not None:
                return route
            waited = time.monotonic() - began
            if waited >= self.config.missing_blocks_timeout_s:
                missing = missing_blocks(self._views(), start, end, banned=banned)
                raise MissingBlocksError(missing or list(range(start, end)), waited)
            await asyncio.sleep(MISSING_BLOCKS_POLL_S)
            await self.refresh()

    def ban(self, peer_id: str, reason: object) -> None:
        """Avoid a failed server for a while; each further failure doubles the ban (up to ban_max_s)."""
        failures = self._bans.get(peer_id, (0.0, 0))[1] + 1
        duration = min(self.config.ban_base_s * 2 ** (failures - 1), self.config.ban_max_s)
        self._bans[peer_id] = (time.monotonic() + duration, failures)
        self._connected.discard(peer_id)
        logger.warning("Server ...%s failed (%s); avoiding it for %.1f s", peer_id[-6:], reason, duration)

    def cool_down(self, peer_id: str, reason: object) -> None:
        """Avoid a busy server briefly; unlike ban() this is no failure of it and never grows."""
        self._cool_downs[peer_id] = time.monotonic() + self.config.ban_base_s
        logger.info("Server ...%s is busy (%s); avoiding it for %.1f s", peer_id[-6:], reason, self.config.ban_base_s)

    def record_success(self, peer_id: str, round_trip_s: float) -> None:
        self._bans.pop(peer_id, None)
        self._cool_downs.pop(peer_id, None)
        self.record_latency(peer_id, round_trip_s)

    def record_latency(self, peer_id: str, round_trip_s: float) -> None:
        old = self._latency.get(peer_id)
        self._latency[peer_id] = round_trip_s if old is None else old + LATENCY_EMA_WEIGHT * (round_trip_s - old)

    async def ensure_connected(self, peer_id: str) -> PeerID:
        """Tell p2pd the announced addresses of a server before the first call (it may not have met it via the DHT)."""
        peer = PeerID.from_base58(peer_id)
        record = self.servers.get(peer_id)
        if peer_id not in self._connected and record is not None and record.addrs:
            # hivemind has no public connect(); its own code calls the daemon client the same way
            # the daemon wants transport addresses: drop the trailing /p2p/<peer id> of announced multiaddrs
            addrs = [Multiaddr(addr.split("/p2p/")[0]) for addr in record.addrs]
            await self.p2p._client.connect(peer, addrs)
            self._connected.add(peer_id)
        return peer
