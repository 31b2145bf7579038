"""Simulated users: chat sessions that generate token by token and training jobs that run forward and backward,
routed by find_route as the client routes, banning failed servers and replaying a lost span's history."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from swarmlm.client.health import ban_seconds
from swarmlm.client.sequence_manager import MISSING_BLOCKS_POLL_S
from swarmlm.config import ClientConfig
from swarmlm.sim import scenario as sc
from swarmlm.sim.engine import Engine
from swarmlm.sim.metrics import Metrics
from swarmlm.sim.world import Server, World
from swarmlm.swarm.records import ServerState
from swarmlm.swarm.routing import Policy, RouteSpan, ServerView, bounded_priors, find_route

CLIENT = ClientConfig()
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
    """The routing views of each client region, rebuilt when the records change, and the find_route call."""

    def __init__(self, world: World):
        self.world = world
        self._views: dict[int, tuple[int, list[ServerView]]] = {}

    def views(self, region: int) -> list[ServerView]:
        """Online records as a client of `region` sees them: the round trip it pinged and the announced throughput
        bounded as SwarmView bounds it (client/swarm_view.py)."""
        cached = self._views.get(region)
        if cached is not None and cached[0] == self.world.version:
            return cached[1]
        online = [(sid, r) for sid, r in self.world.records.items() if r.state == ServerState.ONLINE]
        priors = bounded_priors([r.throughput for _, r in online])
        rtt = self.world.scenario.rtt_ms[region]
        by_id = self.world.by_id
        views = [ServerView(sid, r.start, r.end, prior, rtt[by_id[sid].region] / 1000)
                 for (sid, r), prior in zip(online, priors, strict=True)]  # fmt: skip
        self._views[region] = (self.world.version, views)
        return views

    def route(self, client: Client, start: int, end: int, tokens: int, policy: Policy) -> list[Hop] | None:
        now = self.world.engine.now
        banned = {sid for sid, (until, _) in client.bans.items() if until > now}
        spans = find_route(self.views(client.region), start, end, banned=banned, tokens=tokens, rng=client.rng,
                           tie_tolerance=CLIENT.route_tie_tolerance, prefer=client.used,
                           stickiness=CLIENT.route_stickiness, policy=policy,
                           full_tokens=CLIENT.max_tokens_per_request)  # fmt: skip
        if spans is None:
            return None
        return [self._hop(span) for span in spans]

    def _hop(self, span: RouteSpan) -> Hop:
        server = self.world.by_id[span.peer_id]
        return Hop(server, span.start, span.end, server.epoch)


@dataclass
class Client:
    """What a client remembers between calls: its bans and the servers it used last."""

    cid: int
    region: int
    rng: random.Random
    bans: dict[str, tuple[float, int]] = field(default_factory=dict)  # server -> (banned until, failures)
    used: set[str] = field(default_factory=set)  # servers of its present route (preferred: stickiness)

    def ban(self, sid: str, now: float) -> None:
        failures = self.bans.get(sid, (0.0, 0))[1] + 1
        self.bans[sid] = (now + ban_seconds(failures, CLIENT.ban_base_s, CLIENT.ban_max_s), failures)


def hop_rtt_s(scenario: sc.Scenario, client: Client, hop: Hop) -> float:
    """A hop's round trip from the client and its fixed cost."""
    return scenario.rtt_ms[client.region][hop.server.region] / 1000 + scenario.hop_s


class Session:
    """A chain of hops over all blocks that can lose spans and rebuild them; subclasses say what a step costs."""

    policy: Policy = "latency"
    _keys = itertools.count()

    def __init__(self, client: Client, world: World, router: Router, metrics: Metrics):
        self.client, self.world, self.router, self.metrics = client, world, router, metrics
        self.engine: Engine = world.engine
        self.key = next(Session._keys)  # its name in the servers' holders
        self.hops: list[Hop] = []
        self.waited = 0.0
        self.history = 0  # tokens the servers' caches hold (replayed when a span is rebuilt)

    def tokens(self) -> int:
        return 1

    def open(self, then: str) -> None:
        """Find a route over all blocks (waiting for missing ones as make_route does), then call self.<then>()."""
        hops = self.router.route(self.client, 0, self.world.B, self.tokens(), self.policy)
        if hops is None:
            self._wait(self.open, then)
            return
        self._adopt(hops)
        self.waited = 0.0
        getattr(self, then)()

    def _wait(self, retry: Callable[..., Any], *args: object) -> None:
        self.waited += MISSING_BLOCKS_POLL_S
        if self.waited > CLIENT.missing_blocks_timeout_s:
            self.metrics.failed(self.world.uncovered == 0)
            self.close()
            return
        self.engine.after(MISSING_BLOCKS_POLL_S, retry, *args)

    def _adopt(self, hops: list[Hop]) -> None:
        self.hops = hops
        self.client.used = {hop.server.sid for hop in hops}
        for hop in hops:
            hop.server.holders[self.key] = None

    def close(self) -> None:
        for hop in self.hops:
            hop.server.holders.pop(self.key, None)
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
        lost.server.holders.pop(self.key, None)
        new = self.router.route(self.client, lost.start, lost.end, self.tokens(), self.policy)
        if new is None:
            self._wait(self._rebuild, i, then)
            return
        self.waited = 0.0
        self.metrics.recoveries += 1
        self.metrics.replayed_tokens += self.history
        # the replay: the history in request-sized steps through the new hops, at their compute throughput
        scenario, history = self.world.scenario, self.history
        replay = sum(hop_rtt_s(scenario, self.client, hop) + history * (hop.end - hop.start) / hop.server.throughput
                     for hop in new) if history else 0.0  # fmt: skip
        self._adopt(self.hops[:i] + new + self.hops[i + 1 :])
        self.engine.after(replay, getattr(self, then))
