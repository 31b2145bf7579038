"""The client's link to the swarm: its DHT node and P2P handle, composing the swarm view, health and dialing."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Collection, Iterable
from dataclasses import replace

from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils import get_dht_time

from swarmlm.client.health import Health, busy_cool_down_s
from swarmlm.client.latency import measure_all
from swarmlm.client.swarm_view import ServerFilter, SwarmView
from swarmlm.client.verify import Verifier
from swarmlm.client.wire import wire_dtype_of
from swarmlm.config import ClientConfig
from swarmlm.errors import MissingBlocksError, RemoteCallError, SwarmBusyError, UnreachableError
from swarmlm.net.dialing import Dialer
from swarmlm.net.patches import quiet_transport_logs
from swarmlm.swarm import private, reports
from swarmlm.swarm.dht import ParentBoundDHT, is_loopback_maddr, start_dht
from swarmlm.swarm.private import blind_prefix
from swarmlm.swarm.records import ServerRecord, fetch_servers
from swarmlm.swarm.route_choice import Knowledge, RouteChoice, RouteRequest, choose_route
from swarmlm.swarm.routing import RouteSpan, ServerView, find_route, missing_blocks, policy_for

logger = logging.getLogger(__name__)

# polling interval while waiting for missing blocks to be served
MISSING_BLOCKS_POLL_S = 0.5
# servers whose announced dtype is remembered after their records lapse (the stalest are forgotten first)
MAX_REMEMBERED_DTYPES = 4096


def fitting_tokens(spans: Iterable[tuple[int, int, int | None]], start: int, end: int) -> int | None:
    """The largest request that some server of every block of [start, end) accepts, from (start, end, announced
    limit or None for none announced) of each server; None when no block is limited (or none is served)."""
    best: dict[int, float] = {}
    for lo, hi, limit in spans:
        for block in range(max(lo, start), min(hi, end)):
            best[block] = max(best.get(block, 0), float("inf") if limit is None else limit)
    smallest = min(best.values(), default=float("inf"))
    return None if smallest == float("inf") else int(smallest)


def _first_line(error: BaseException) -> str:
    """An error's first line (p2pd lists every address it dialled, one per line)."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


class SequenceManager:
    """Owns the client's DHT node and P2P handle; lives on (and must be used from) the client's event loop.

    fingerprint: the model's (models/fingerprint.py); only servers announcing it are used (None: no check).
    """

    def __init__(self, config: ClientConfig, dht_prefix: str, num_blocks: int, fingerprint: str | None = None):
        if config.swarm_key is not None:  # a private swarm's records live under a name only members can compute
            dht_prefix = blind_prefix(dht_prefix, config.swarm_key)
        self.config, self.dht_prefix, self.num_blocks = config, dht_prefix, num_blocks
        self.dht: ParentBoundDHT | None = None
        self.p2p: P2P | None = None
        self.view = SwarmView(
            ServerFilter.of(
                fingerprint,
                config.accepted_dtypes,
                config.allowed_servers,
                config.blocked_servers,
                adapter=config.active_adapter,
            )
        )
        self.health = Health(config.ban_base_s, config.ban_max_s)
        self.verifier = Verifier(config.verify_probability, config.verify_first_requests)
        self._my_reports: dict[str, reports.Report] = {}  # servers this client caught, as published on the DHT
        self._background: set[asyncio.Task] = set()  # report publications in flight
        self.wire = wire_dtype_of(config.wire_dtype)  # what float32 activations travel as (client/wire.py)
        # what routes minimize (config.routing, checked here): for batch work, and for routes opening sessions
        self.batch_policy = policy_for(config.routing, inference=False)
        self.session_policy = policy_for(config.routing, inference=True)
        self._dialer = Dialer(min(config.request_timeout_s, config.connect_timeout_s))
        self._joined: set[str] = set()  # servers of a private swarm this client proved its membership to
        self._rng = random.Random()
        self._last_used: dict[str, float] = {}  # peer -> when a route last went through it (monotonic s)
        self._explored_at = time.monotonic()  # when a route last tried an unmeasured server (none at first)
        self._refresh_task: asyncio.Task | None = None
        # the dtype each server announced when last in view: a spot check of a server whose record has since
        # lapsed (late to re-announce) keeps its tolerance, not the coarsest one, which would pass wrong results
        self._dtypes: dict[str, str] = {}

    @property
    def servers(self) -> dict[str, ServerRecord]:
        """Online servers this client accepts, by peer id."""
        return self.view.servers

    async def start(self) -> None:
        peers = self.config.initial_peers
        host = "127.0.0.1" if peers and all(is_loopback_maddr(p) for p in peers) else "0.0.0.0"
        quiet_transport_logs()
        self.dht = await asyncio.to_thread(
            start_dht, peers, host=host, client_mode=True, swarm_key=self.config.swarm_key
        )
        self.p2p = await self.dht.replicate_p2p()
        await self.refresh()
        self._refresh_task = asyncio.create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
        for task in list(self._background):
            task.cancel()
        if self.p2p is not None:
            await self.p2p.shutdown()
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)

    async def refresh(self) -> None:
        try:
            async with asyncio.timeout(self.config.dht_timeout_s):
                records = await fetch_servers(self.dht, self.dht_prefix, self.num_blocks)
        except Exception as e:  # noqa: BLE001 - a failed refresh keeps the previous view; the next one retries
            logger.warning("Reading the swarm from the DHT failed: %s", repr(e))
            return
        self.view.update(records)
        self._remember_dtypes()
        try:
            async with asyncio.timeout(self.config.dht_timeout_s):
                self.verifier.reported = set(await reports.fetch_reported(self.dht, self.dht_prefix))
        except Exception as e:  # noqa: BLE001 - reports only tune how often servers are checked; retried next time
            logger.warning("Reading reports of wrong results from the DHT failed: %s", repr(e))

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.swarm_refresh_interval_s)
            await self.refresh()

    def _excluded(self, tokens: int, avoid: Collection[str], busy_too: bool = True) -> set[str]:
        """Servers a route for `tokens` tokens must not use: banned, cooling down after a busy answer (unless not
        busy_too), avoided, or announcing a smaller per-request limit."""
        too_small = {peer for peer in self.servers if (self.max_tokens_of(peer) or tokens) < tokens}
        avoided = self.health.banned() if busy_too else self.health.avoided()
        return avoided | set(avoid) | too_small

    def _remember_dtypes(self) -> None:
        for peer, record in self.servers.items():
            self._dtypes.pop(peer, None)  # re-inserted last: the stalest entries come first
            self._dtypes[peer] = record.dtype
        while len(self._dtypes) > MAX_REMEMBERED_DTYPES:
            del self._dtypes[next(iter(self._dtypes))]

    def dtype_of(self, peer_id: str) -> str:
        """The compute dtype a server announces, or announced when last in view ("unknown" for one never seen:
        the coarsest tolerance)."""
        record = self.servers.get(peer_id)
        return self._dtypes.get(peer_id, "unknown") if record is None else record.dtype

    def max_tokens_of(self, peer_id: str) -> int | None:
        """The per-request token limit a server announces, if it announces one."""
        limit = getattr(self.servers.get(peer_id), "max_tokens_per_request", None)
        return limit if isinstance(limit, int) and limit > 0 else None

    def request_limit(self, start: int, end: int) -> int:
        """The most tokens one request over blocks [start, end) carries: the client's own max_tokens_per_request,
        and no more than some server of every block announces it accepts."""
        announced = [(r.start, r.end, self.max_tokens_of(peer)) for peer, r in self.servers.items()]
        limit = fitting_tokens(announced, start, end)
        mine = self.config.max_tokens_per_request
        return mine if limit is None else min(mine, limit)

    def can_route(self, start: int, end: int, tokens: int = 1, avoid: Collection[str] = ()) -> bool:
        """Whether a route over [start, end) exists right now without the excluded servers (never waits)."""
        views = self.view.views(self.health)
        return find_route(views, start, end, banned=self._excluded(tokens, avoid), tokens=tokens) is not None

    async def make_route(
        self,
        start: int,
        end: int,
        tokens: int = 1,
        avoid: Collection[str] = (),
        session_tokens: int | None = None,
        spread: bool = True,
        busy_since: float | None = None,
    ) -> list[RouteSpan]:
        """A route over blocks [start, end) for `tokens` tokens, without the servers in `avoid`; waits for missing
        blocks up to the configured timeout. session_tokens (batch x max_length): the route opens inference
        sessions of this size (servers announcing too little free cache are avoided while others can serve their
        blocks) and follows the session policy, others the batch policy (config.routing). Without spread, the
        cheapest route is taken and missing blocks are not waited for (spot checks). The choice itself is
        swarm/route_choice.py's choose_route, the function the simulator runs too.

        When a route exists only through servers that answered busy, the swarm is full: the route is waited for up
        to busy_wait_s (counted from busy_since, the request's first busy answer, when given), then SwarmBusyError
        tells the caller when to come back."""
        began = time.monotonic()
        policy = self.batch_policy if session_tokens is None else self.session_policy
        request = RouteRequest(start, end, tokens, policy, session_tokens, spread)
        await self.measure_unknown(start, end)
        while True:
            views = self.view.views(self.health)
            known = self._knowledge(views, tokens, avoid, spread)
            choice = choose_route(views, request, known, self._rng)
            if choice is not None:
                self._took(choice, start, end)
                return choice.route
            lacking = self.view.missing_adapter(start, end)
            if lacking is not None:  # servers answer for those blocks, none with the adapter: no wait would help
                raise lacking
            now = time.monotonic()
            waited = now - began
            # blocks that only busy servers hold are the swarm being full, not missing: busy_wait_s applies to them,
            # counted from the request's first busy answer
            full = self._only_busy(views, request, known)
            busy_waited = now - min(began, busy_since or began)
            if full and busy_waited >= self.config.busy_wait_s:
                raise SwarmBusyError(start, end, busy_waited, self.health.cooling_left_s())
            timed_out = waited >= self.config.missing_blocks_timeout_s and not full
            if timed_out or not spread:  # a spot check never waits for servers
                missing = missing_blocks(views, start, end, banned=known.banned)
                raise MissingBlocksError(missing or list(range(start, end)), waited)
            await asyncio.sleep(MISSING_BLOCKS_POLL_S)
            await self.refresh()

    def _knowledge(self, views: list[ServerView], tokens: int, avoid: Collection[str], spread: bool) -> Knowledge:
        """What choose_route needs of this client's state: bans, busy cool-downs, recent servers, unmeasured ones."""
        config, health = self.config, self.health
        busy = frozenset(health.cooling())
        banned = frozenset(self._excluded(tokens, avoid, busy_too=False))
        recent = time.monotonic() - config.sticky_route_s
        interval = config.explore_interval_s
        explore = spread and interval > 0 and time.monotonic() - self._explored_at >= interval
        unmeasured = frozenset(
            v.peer_id for v in views if not health.has_measured(v.peer_id) and health.answered(v.peer_id)
        )
        return Knowledge(
            banned=banned, busy=busy, prefer=frozenset(p for p, when in self._last_used.items() if when > recent),
            unmeasured=unmeasured if explore else frozenset(), explore=explore,
            tie_tolerance=config.route_tie_tolerance, stickiness=config.route_stickiness,
            full_tokens=config.max_tokens_per_request,
        )  # fmt: skip

    def _took(self, choice: RouteChoice, start: int, end: int) -> None:
        now = time.monotonic()
        if choice.explored is not None:
            self._explored_at = now
            logger.info("Trying server ...%s (never measured) for blocks %d:%d", choice.explored[-6:], start, end)
        self._last_used.update((span.peer_id, now) for span in choice.route)

    @staticmethod
    def _only_busy(views: list[ServerView], request: RouteRequest, known: Knowledge) -> bool:
        """Whether a route exists, but only through servers cooling down after a busy answer."""
        return bool(known.busy) and choose_route(views, request, replace(known, busy=frozenset()), None) is not None

    async def measure_unknown(self, start: int, end: int) -> None:
        """Time a round trip to each server of blocks [start, end) this client never measured, so that the first
        route already prefers near servers (client/latency.py); at most ping_timeout_s, all at once."""
        timeout_s = self.config.ping_timeout_s
        if timeout_s <= 0 or self.p2p is None:
            return
        unknown = [peer for peer, r in self.servers.items()
                   if r.start < end and r.end > start and not self.health.knows_latency(peer)]  # fmt: skip
        if unknown:
            await measure_all(
                unknown, self.ensure_connected, self.p2p, timeout_s, self.health.record_ping, self._unanswered_ping
            )

    def _unanswered_ping(self, peer_id: str) -> None:
        duration = self.health.record_unanswered_ping(peer_id, self.config.ping_timeout_s)
        self._forget(peer_id)
        logger.info("Server ...%s did not answer a ping; avoiding it for %.1f s", peer_id[-6:], duration)

    def ban(self, peer_id: str, reason: object) -> None:
        """Avoid a failed server for a while; each further failure doubles the ban (up to ban_max_s)."""
        duration = self.health.ban(peer_id)
        self._forget(peer_id)
        # INFO: the request goes on elsewhere (its trace counts the retry); if it cannot, its error says why
        logger.info("Server ...%s failed (%s); avoiding it for %.1f s", peer_id[-6:], reason, duration)

    def unreachable(self, peer_id: str, reason: object) -> None:
        """Avoid a server that could not be connected to, like a failed one (its record may be a stranger's claim:
        one line at INFO, not a warning per fake record)."""
        duration = self.health.unreachable(peer_id)
        self._forget(peer_id)
        logger.info("Server ...%s is unreachable (%s); avoiding it for %.1f s", peer_id[-6:], reason, duration)

    def _forget(self, peer_id: str) -> None:
        self._dialer.forget(peer_id)
        self._joined.discard(peer_id)  # a restarted server forgot us: join again
        self._last_used.pop(peer_id, None)  # once its ban is over, a failed server earns no stickiness

    def convict(self, peers: tuple[str, ...], reason: str, start: int, end: int) -> None:
        """Servers whose result lost a spot check: this client never uses them again, and reports a lone culprit
        on the DHT (where several servers produced the wrong result together, which one lied is unknown)."""
        for peer_id in peers:
            self.health.distrust(peer_id)
            self._dialer.forget(peer_id)
            self._last_used.pop(peer_id, None)
            logger.warning("Server ...%s returned a wrong result (%s); not using it again", peer_id[-6:], reason)
        if len(peers) == 1 and self.dht is not None and self.p2p is not None:
            self._my_reports[peers[0]] = reports.Report(reason=reason[:300], start=start, end=end, time=get_dht_time())
            task = asyncio.create_task(self._publish_reports())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _publish_reports(self) -> None:
        if self.p2p is None:
            return
        try:
            async with asyncio.timeout(self.config.dht_timeout_s):
                mine, ttl_s = self.p2p.peer_id.to_base58(), self.config.report_ttl_s
                stored = await reports.publish(self.dht, self.dht_prefix, mine, self._my_reports, ttl_s)
            if not stored:
                logger.warning("Storing reports of wrong results on the DHT failed")
        except Exception as e:  # noqa: BLE001 - the ban holds anyway; only other clients miss the report
            logger.warning("Publishing reports of wrong results failed: %s", repr(e))

    def cool_down(self, peer_id: str, reason: object, retry_after_s: float | None = None) -> None:
        """Avoid a busy server briefly: for the wait it suggested (retry_after_s), at least ban_base_s and at most
        busy_wait_s; unlike ban() this is no failure of it and never grows."""
        config = self.config
        seconds = busy_cool_down_s(retry_after_s, config.ban_base_s, config.busy_wait_s)
        self.health.cool_down(peer_id, seconds)
        self._last_used.pop(peer_id, None)  # a busy server is not preferred once the cool-down is over
        logger.info("Server ...%s is busy (%s); avoiding it for %.1f s", peer_id[-6:], reason, seconds)

    def record_success(self, peer_id: str, round_trip_s: float, work: float = 1.0) -> None:
        """A call to `peer_id` of `work` block-tokens took round_trip_s in total (compute included), by our clock."""
        self.health.record_success(peer_id, round_trip_s, work)

    async def ensure_connected(self, peer_id: str) -> PeerID:
        """Tell p2pd the announced addresses of a server before the first call (it may not have met it via the DHT)."""
        peer = PeerID.from_base58(peer_id)
        record = self.servers.get(peer_id)
        if record is not None:
            try:
                await self._dialer.ensure_connected(self.p2p, peer, record.addrs)
            except (TimeoutError, P2PDaemonError, ConnectionError, OSError) as e:
                raise UnreachableError(
                    f"connecting to its announced addresses failed: {_first_line(e)}", peer_id
                ) from e
        key = self.config.swarm_key
        if key is not None and peer_id not in self._joined:
            if not await private.join(self.p2p, peer, key, self.config.request_timeout_s):
                raise RemoteCallError("the server refused this client's swarm key (another private swarm?)", peer_id)
            self._joined.add(peer_id)
        return peer
