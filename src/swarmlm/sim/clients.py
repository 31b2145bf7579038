"""Simulated users: chat sessions that generate token by token and training jobs that run forward and backward,
routed by choose_route as the client routes, admitted or refused by the servers' limits, banning failed servers,
cooling busy ones down and replaying a lost span's history."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from swarmlm.client.health import ban_seconds, busy_cool_down_s
from swarmlm.client.sequence_manager import MISSING_BLOCKS_POLL_S
from swarmlm.client.swarm_view import load_of
from swarmlm.config import ClientConfig, ServerConfig
from swarmlm.sim import scenario as sc
from swarmlm.sim.engine import Engine
from swarmlm.sim.metrics import Metrics
from swarmlm.sim.world import Server, World
from swarmlm.swarm.records import ServerState
from swarmlm.swarm.route_choice import Knowledge, RouteRequest, choose_route
from swarmlm.swarm.routing import Policy, RouteSpan, ServerView, bounded_priors

CLIENT = ClientConfig()
# how often a server's record (its load and free cache) is refreshed on the DHT
ANNOUNCE_S = ServerConfig(model="sim").announce_interval_s
# bytes of one token's hidden state on the wire (16 bits)
TOKEN_BYTES = sc.HIDDEN_SIZE * 2


@dataclass
class Hop:
    """A span of a route and the server's session epoch when it was opened there (a later epoch: it was lost)."""

    server: Server
    start: int
    end: int
    epoch: int

    @property
    def lost(self) -> bool:
        return not self.server.alive or self.server.epoch != self.epoch


class Router:
    """The routing views of each client region, rebuilt when the records change and at least once per announce
    interval (the servers' load and cache room as their latest announcement says), and the choose_route call."""

    def __init__(self, world: World):
        self.world = world
        self._views: dict[int, tuple[int, float, list[ServerView]]] = {}

    def views(self, region: int) -> list[ServerView]:
        """Online records as a client of `region` sees them: the round trip it pinged, the announced throughput
        bounded as SwarmView bounds it (client/swarm_view.py), the announced load and free cache."""
        now = self.world.engine.now
        cached = self._views.get(region)
        if cached is not None and cached[0] == self.world.version and now - cached[1] < ANNOUNCE_S:
            return cached[2]
        online = [(sid, r) for sid, r in self.world.records.items() if r.state == ServerState.ONLINE]
        priors = bounded_priors([r.throughput for _, r in online])
        rtt = self.world.scenario.rtt_ms[region]
        views = [self._view(sid, r.start, r.end, prior, rtt) for (sid, r), prior in zip(online, priors, strict=True)]
        self._views[region] = (self.world.version, now, views)
        return views

    def _view(self, sid: str, start: int, end: int, prior: float, rtt: tuple[float, ...]) -> ServerView:
        server = self.world.by_id[sid]
        queue = server.batches() - 1 if server.generating else 0  # decode turns a new step waits for
        return ServerView(sid, start, end, prior, rtt[server.region] / 1000, load_of(len(server.holders), queue),
                          server.cache_capacity - server.cache_used)  # fmt: skip

    def route(self, client: Client, request: RouteRequest, ignore_busy: bool = False) -> list[Hop] | None:
        """The route choose_route gives this client now (ignore_busy: as if no server had answered busy)."""
        now = self.world.engine.now
        views = self.views(client.region)
        known = client.knowledge(now, views)
        if ignore_busy:
            known = replace(known, busy=frozenset())
        choice = choose_route(views, request, known, client.rng)
        if choice is None:
            return None
        if choice.explored is not None:
            client.explored_at = now
        return [self._hop(span) for span in choice.route]

    def _hop(self, span: RouteSpan) -> Hop:
        server = self.world.by_id[span.peer_id]
        return Hop(server, span.start, span.end, server.epoch)


@dataclass
class Client:
    """What a client remembers between calls: its bans and busy cool-downs, the servers it used last and those it
    timed calls of, and when it last explored."""

    cid: int
    region: int
    rng: random.Random
    bans: dict[str, tuple[float, int]] = field(default_factory=dict)  # server -> (banned until, failures)
    cools: dict[str, float] = field(default_factory=dict)  # server -> avoided until (it answered busy)
    used: set[str] = field(default_factory=set)  # servers of its present route (preferred: stickiness)
    measured: set[str] = field(default_factory=set)  # servers it timed calls of
    explored_at: float = 0.0

    @property
    def peer(self) -> str:
        return f"client{self.cid}"

    def ban(self, sid: str, now: float) -> None:
        failures = self.bans.get(sid, (0.0, 0))[1] + 1
        self.bans[sid] = (now + ban_seconds(failures, CLIENT.ban_base_s, CLIENT.ban_max_s), failures)

    def cool_down(self, sid: str, now: float, retry_after_s: float | None) -> None:
        self.cools[sid] = now + busy_cool_down_s(retry_after_s, CLIENT.ban_base_s, CLIENT.busy_wait_s)

    def cooling_ends(self, now: float) -> float | None:
        """When the first busy server's cool-down ends (None: none cools down)."""
        return min((until for until in self.cools.values() if until > now), default=None)

    def knowledge(self, now: float, views: list[ServerView]) -> Knowledge:
        """What choose_route knows of this client, as SequenceManager._knowledge builds it."""
        explore = CLIENT.explore_interval_s > 0 and now - self.explored_at >= CLIENT.explore_interval_s
        unmeasured = frozenset(v.peer_id for v in views if v.peer_id not in self.measured) if explore else frozenset()
        return Knowledge(
            banned=frozenset(sid for sid, (until, _) in self.bans.items() if until > now),
            busy=frozenset(sid for sid, until in self.cools.items() if until > now),
            prefer=frozenset(self.used), unmeasured=unmeasured, explore=explore,
            tie_tolerance=CLIENT.route_tie_tolerance, stickiness=CLIENT.route_stickiness,
            full_tokens=CLIENT.max_tokens_per_request,
        )  # fmt: skip


def hop_rtt_s(scenario: sc.Scenario, client: Client, hop: Hop) -> float:
    """A hop's round trip from the client and its fixed cost."""
    return scenario.rtt_ms[client.region][hop.server.region] / 1000 + scenario.hop_s


class Session:
    """A chain of hops over all blocks that can lose spans and rebuild them; subclasses say what a step costs.

    Opening a span asks each server of the route for a session slot and cache room (server/admission.py, as the
    real server decides); a busy server cools down on the client for the wait it suggested and the route is chosen
    again. When only busy servers are left the client waits, for at most busy_wait_s, then gives up: a new user is
    refused (told the swarm is busy), an admitted session that lost a span fails."""

    policy: Policy = "latency"
    _keys = itertools.count()

    def __init__(self, client: Client, world: World, router: Router, metrics: Metrics):
        self.client, self.world, self.router, self.metrics = client, world, router, metrics
        self.engine: Engine = world.engine
        self.key = next(Session._keys)  # its name in the servers' holders
        self.hops: list[Hop] = []
        self.waited = 0.0
        self.busy_since: float | None = None  # when only busy servers were left (None: not now)
        self.history = 0  # tokens the servers' caches hold (replayed when a span is rebuilt)
        self.was_admitted = False  # its first route took it

    def tokens(self) -> int:
        return 1

    def session_tokens(self) -> int | None:
        """Cache tokens its sessions reserve at each block (None: stateless work, no session)."""
        return None

    def _request(self, start: int, end: int) -> RouteRequest:
        return RouteRequest(start, end, self.tokens(), self.policy, self.session_tokens())

    def _admitted(self, start: int, end: int) -> list[Hop] | None:
        """A route over [start, end) whose servers all took the session; None when none is left to ask."""
        while True:
            hops = self.router.route(self.client, self._request(start, end))
            if hops is None or self._admit(hops):
                return hops

    def _admit(self, hops: list[Hop]) -> bool:
        """Open the session on every hop's server; at the first refusal close those opened and cool it down."""
        size = self.session_tokens()
        if size is None:
            return True
        now, peer = self.engine.now, self.client.peer
        for i, hop in enumerate(hops):
            refused = hop.server.admit(self.key, peer, size * (hop.end - hop.start), now)
            if refused is None:
                continue
            for opened in hops[:i]:
                opened.server.release(self.key, peer, now)
            self.metrics.busy_answers += 1
            self.client.cool_down(hop.server.sid, now, hop.server.retry_after_s())
            return False
        return True

    def _full(self, start: int, end: int) -> bool:
        """Whether servers that answered busy are all that is left for [start, end) (else blocks are missing)."""
        return self.client.cooling_ends(self.engine.now) is not None and (
            self.router.route(self.client, self._request(start, end), ignore_busy=True) is not None
        )

    def _wait_for_room(self, retry: Callable[..., Any], *args: object) -> bool:
        """The swarm is full: wait for the first cool-down to end, until busy_wait_s passed (then False)."""
        now = self.engine.now
        self.busy_since = now if self.busy_since is None else self.busy_since
        deadline = self.busy_since + CLIENT.busy_wait_s
        if now >= deadline:
            return False
        self.engine.at(min(deadline, self.client.cooling_ends(now) or deadline), retry, *args)
        return True

    def open(self, then: str) -> None:
        """Find a route over all blocks with room (waiting for missing blocks as make_route does, for room up to
        busy_wait_s), then call self.<then>()."""
        hops = self._admitted(0, self.world.B)
        if hops is None:
            if not self._full(0, self.world.B):
                self._wait(self.open, then)
            elif not self._wait_for_room(self.open, then):
                self.metrics.refused += 1
                self.close()
            return
        self._adopt(hops)
        self.waited, self.busy_since = 0.0, None
        if not self.was_admitted:
            self.was_admitted = True
            self.admitted()
        getattr(self, then)()

    def admitted(self) -> None:
        """Told when its first route took it (a chat counts its admission)."""

    def _wait(self, retry: Callable[..., Any], *args: object) -> None:
        self.waited += MISSING_BLOCKS_POLL_S
        if self.waited > CLIENT.missing_blocks_timeout_s:
            self.metrics.failed(self.world.uncovered == 0)
            self.metrics.admitted_failed += self.was_admitted
            self.close()
            return
        self.engine.after(MISSING_BLOCKS_POLL_S, retry, *args)

    def _adopt(self, hops: list[Hop]) -> None:
        self.hops = hops
        self.client.used = {hop.server.sid for hop in hops}

    def close(self) -> None:
        for hop in self.hops:
            if not hop.lost:
                hop.server.release(self.key, self.client.peer, self.engine.now)
        self.hops = []

    def check(self, then: str) -> bool:
        """Whether every hop is intact; otherwise start rebuilding the first lost one and call self.<then>() when
        done (returns False)."""
        for i, hop in enumerate(self.hops):
            if hop.lost:
                crashed = not hop.server.alive
                # a silent server is found out when the liveness ping fails, after twice liveness_check_s; the client
                # bans it then (a closed session is no failure of its server)
                delay = 2 * CLIENT.liveness_check_s if crashed else 0.0
                self.engine.after(delay, self._failed, i, then, crashed)
                return False
        return True

    def _failed(self, i: int, then: str, crashed: bool) -> None:
        if crashed:
            self.client.ban(self.hops[i].server.sid, self.engine.now)
        self._rebuild(i, then)

    def _rebuild(self, i: int, then: str) -> None:
        lost = self.hops[i]
        if not lost.lost:
            lost.server.release(self.key, self.client.peer, self.engine.now)
        new = self._admitted(lost.start, lost.end)
        if new is None:
            if not self._full(lost.start, lost.end):
                self._wait(self._rebuild, i, then)
            elif not self._wait_for_room(self._rebuild, i, then):
                self.metrics.failed_busy += 1
                self.metrics.admitted_failed += self.was_admitted
                self.close()
            return
        self.waited, self.busy_since = 0.0, None
        self.metrics.recoveries += 1
        self.metrics.replayed_tokens += self.history
        # the replay: the history in request-sized steps through the new hops, at their compute throughput; only
        # servers that took the session (cache room) replay, so a replay never pushes out admitted sessions
        scenario, history = self.world.scenario, self.history
        replay = sum(hop_rtt_s(scenario, self.client, hop) + history * (hop.end - hop.start) / hop.server.throughput
                     for hop in new) if history else 0.0  # fmt: skip
        self._adopt(self.hops[:i] + new + self.hops[i + 1 :])
        self.engine.after(replay, getattr(self, then))
