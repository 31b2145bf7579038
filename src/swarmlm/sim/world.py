"""The simulated servers: their hardware and regions, their records as the DHT shows them, joining, draining,
moving and crashing, and which blocks are covered."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from swarmlm.config import ServerConfig
from swarmlm.server.admission import SessionLengths, admit_now
from swarmlm.server.peers import LimitError, PeerLedger, PeerLimits
from swarmlm.server.scheduling import LONG_TURNS, BatchLimits
from swarmlm.sim import scenario as sc
from swarmlm.sim.engine import Engine, Event
from swarmlm.sim.metrics import Metrics
from swarmlm.sim.rules import Rule, make_rule, totals_of
from swarmlm.swarm.records import ServerRecord, ServerState

SERVER_DEFAULTS = ServerConfig(model="sim")
# sessions the real scheduler runs in one batched decode step (server/scheduling.py): more wait for the next batch;
# and the quanta of long work (training passes) it runs between two decode batches, of QUANTUM_TOKENS each
DECODE_BATCH = BatchLimits().max_sessions
QUANTUM_TOKENS = BatchLimits().quantum_tokens
# bytes a simulated peer may have buffered (requests are not simulated byte by byte: never the limit)
PEER_BYTES = 1 << 30
# loading a span: start-up plus reading each block's weights from local disk (~1 GB/s), plus up to this much
# jitter (claims, downloads)
LOAD_BASE_S, LOAD_PER_GB_S, LOAD_JITTER_S = 20.0, 1.0, 10.0


@dataclass
class Server:
    """One server machine; its record (what others see) lives in World.records while it is announced."""

    sid: str
    gpu: sc.Gpu
    region: int
    n: int  # blocks it holds
    single_s: float  # one block's decode step of one session (sc.decode_step_s)
    throughput: float  # announced block-tokens/s (sc.compute_throughput)
    net_bps: float  # network bandwidth, bytes/s
    batch_slope: float = sc.BATCH_SLOPE  # its batched step's growth per session (sc.batched_step_s)
    alive: bool = False  # the process runs (a crashed server's record may still be announced)
    serving: bool = False  # alive and ONLINE: takes sessions and counts for coverage
    start: int = 0
    end: int = 0
    epoch: int = 0  # bumped whenever the sessions it held are lost (crash, drain deadline)
    life: int = 0  # bumped at each join: a departure drawn for an earlier session of the server is void
    generating: int = 0  # sessions running a decode step on it now
    training: int = 0  # training requests it computes now
    # sessions with a cache on it: key -> (cache block-tokens, when opened) (ordered, deterministic)
    holders: dict[int, tuple[int, float]] = field(default_factory=dict)
    check: Event | None = None  # its next rebalance check
    limits: PeerLimits | None = None  # the real server's session and cache limits (server/peers.py)
    ledger: PeerLedger | None = None  # what each peer holds, as the real server counts it
    cache_capacity: int = 0  # KV-cache budget, block-tokens (cache_tokens x blocks held, as the server sets it)
    cache_used: int = 0
    lengths: SessionLengths = field(default_factory=SessionLengths)  # its sessions' lengths: the busy retry hint

    def batches(self) -> int:
        """Batched decode steps a round of its generating sessions takes (the scheduler's batch size caps each)."""
        return max(1, -(-self.generating // DECODE_BATCH))

    def step_s(self, blocks: int) -> float:
        """A decode step of `blocks` of its blocks at its present batch. With training work queued, the real
        scheduler runs LONG_TURNS quanta of it (QUANTUM_TOKENS at one block each) before each decode batch."""
        batch = min(max(1, self.generating), DECODE_BATCH)
        step = sc.batched_step_s(self.single_s, batch, self.batch_slope)
        long_work = LONG_TURNS * QUANTUM_TOKENS / self.throughput if self.training else 0.0
        return (blocks * step + long_work) * self.batches()

    def reset_sessions(self, limits: PeerLimits) -> None:
        """No session holds anything (it started, crashed, or closed them all)."""
        self.holders.clear()
        self.limits, self.ledger, self.cache_used = limits, PeerLedger(limits), 0

    def admit(self, key: int, peer: str, tokens: int, now: float) -> LimitError | None:
        """Open a session of `peer` reserving `tokens` cache block-tokens, as the real server decides
        (server/admission.py); the refusal when it has no room."""
        if self.ledger is None:
            raise RuntimeError("a server takes sessions only once it serves")
        refused = admit_now(self.ledger, self.cache_used, self.cache_capacity, peer, tokens)
        if refused is None:
            self.ledger.add_cache(peer, tokens)
            self.cache_used += tokens
            self.holders[key] = (tokens, now)
        return refused

    def release(self, key: int, peer: str, now: float) -> None:
        """A session closes: its slot and cache come back."""
        held = self.holders.pop(key, None)
        if held is None or self.ledger is None:
            return
        tokens, opened = held
        self.ledger.add_cache(peer, -tokens)
        self.ledger.close_session(peer)
        self.cache_used -= tokens
        self.lengths.end(now - opened)

    def retry_after_s(self) -> float:
        return self.lengths.retry_after_s(len(self.holders))


class World:
    """Servers, their records, the placement rule, and coverage over time."""

    def __init__(self, scenario: sc.Scenario, engine: Engine, rng: random.Random, metrics: Metrics):
        self.scenario, self.engine, self.rng, self.metrics = scenario, engine, rng, metrics
        self.B = scenario.num_blocks
        self.rule: Rule = make_rule(scenario.placement, scenario.balance_quality, random.Random(rng.random()))
        # the checks' jitter has a generator of its own: rules that check at other intervals (Petals' every 120 s)
        # then draw the same servers' lives, crashes and lapses from `rng`, so that runs of two rules differ by what
        # the rules decide, not by where the shared stream of random numbers went
        self.check_rng = random.Random(rng.random())
        self.records: dict[str, ServerRecord] = {}
        self.version = 0  # bumped at every change of records
        self._totals: tuple[int, list[float]] = (-1, [])
        self.cover = [0] * self.B  # serving servers per block
        self.uncovered = self.B
        self.limits = PeerLimits(PEER_BYTES, SERVER_DEFAULTS.max_sessions_per_peer, scenario.max_sessions,
                                 SERVER_DEFAULTS.peer_cache_share, host_share=SERVER_DEFAULTS.host_share)  # fmt: skip
        self.servers = [self._new_server(i) for i in range(scenario.servers)]
        self.mean_session_tokens = float(sc.MAX_CONTEXT // 2)  # of the chats to come (the bound's session size)
        self.by_id = {s.sid: s for s in self.servers}

    def _new_server(self, i: int) -> Server:
        gpu = self.scenario.gpus[sc.pick(self.rng, tuple(g.share for g in self.scenario.gpus))]
        net_mbits = gpu.net_mbits * self.rng.lognormvariate(0.0, 0.5)
        region = sc.pick(self.rng, self.scenario.region_shares)
        return Server(f"s{i:05d}", gpu, region, sc.blocks_held(gpu, self.B), sc.decode_step_s(gpu),
                      sc.compute_throughput(gpu), net_mbits * 1e6 / 8, self.scenario.batch_slope)  # fmt: skip

    def start(self) -> None:
        """Each server is online at the start with the share of time it spends online, joining in the first
        minutes; the others come up after a pause."""
        up_share = self.scenario.uptime_median_h / (self.scenario.uptime_median_h + self.scenario.downtime_median_h)
        for server in self.servers:
            if self.rng.random() < up_share:
                self.engine.at(self.rng.uniform(0, 600), self.join, server)
            else:
                self.engine.at(sc.lognormal_s(self.rng, self.scenario.downtime_median_h, sc.DOWNTIME_SIGMA),
                               self.join, server)  # fmt: skip
        if self.scenario.outage_hour is not None:
            self.engine.at(self.scenario.outage_hour * 3600, self.outage)

    # records and coverage

    def _announce(self, server: Server, state: ServerState) -> None:
        self.records[server.sid] = ServerRecord(state=state, start=server.start, end=server.end,
                                                throughput=server.throughput, dtype="bfloat16",
                                                since=self.engine.now)  # fmt: skip
        self.version += 1

    def _withdraw(self, sid: str) -> None:
        if self.records.pop(sid, None) is not None:
            self.version += 1

    def totals(self) -> list[float]:
        """block_throughputs of the announced records, computed once per change."""
        if self._totals[0] != self.version:
            self._totals = (self.version, totals_of(self.B, self.records))
        return self._totals[1]

    def _set_serving(self, server: Server, serving: bool) -> None:
        if server.serving == serving:
            return
        server.serving = serving
        delta = 1 if serving else -1
        for b in range(server.start, server.end):
            before = self.cover[b]
            self.cover[b] += delta
            self.uncovered += (before > 0) - (self.cover[b] > 0)
        self.metrics.coverage(self.engine.now, self.uncovered == 0)

    # lifecycle

    def join(self, server: Server, span: tuple[int, int] | None = None) -> None:
        """The server comes up: on `span`, or where its placement rule puts it."""
        if server.alive:
            return
        server.alive = True
        server.life += 1
        server.start, server.end = span or self.rule.join(self.B, server.n, self.records, server.sid)
        server.cache_capacity = self.scenario.cache_tokens * (server.end - server.start)
        server.reset_sessions(self.limits)
        self._announce(server, ServerState.JOINING)
        self.engine.after(self._load_s(server), self._online, server)
        uptime = sc.lognormal_s(self.rng, self.scenario.uptime_median_h, sc.UPTIME_SIGMA)
        self.engine.after(uptime, self.depart, server, server.life)

    def _load_s(self, server: Server) -> float:
        return LOAD_BASE_S + LOAD_PER_GB_S * server.n * sc.block_gb() + self.rng.uniform(0, LOAD_JITTER_S)

    def _online(self, server: Server) -> None:
        if not server.alive:
            return
        self._announce(server, ServerState.ONLINE)
        self._set_serving(server, True)
        self._schedule_check(server)

    def _schedule_check(self, server: Server) -> None:
        interval = self.rule.check_interval_s or self.scenario.rebalance_interval_s
        if interval > 0:  # lifecycle.rebalance_delay's jitter
            server.check = self.engine.after(interval * self.check_rng.uniform(0.5, 1.5), self._rebalance, server)

    def _rebalance(self, server: Server) -> None:
        if not server.serving:
            return
        target = self.rule.move(self.B, server.sid, self.records, self.totals())
        if target is None:
            self._schedule_check(server)
            return
        self.metrics.moves.append(self.engine.now)
        self._drain(server, then=target)

    def depart(self, server: Server, life: int) -> None:
        """The end of a server's session (a crash or a graceful drain), unless it already ended."""
        if not server.alive or server.life != life:
            return
        if self.rng.random() < self.scenario.abrupt_share:
            self.crash(server)
        else:
            self._drain(server, then=None)

    def crash(self, server: Server) -> None:
        """The process dies: sessions on it are lost at once; its record lapses after the record's TTL."""
        self._set_serving(server, False)
        server.alive = False
        self._lose_sessions(server)
        if server.check is not None:
            server.check.cancel()
        ttl = SERVER_DEFAULTS.record_ttl_s
        self.engine.after(self.rng.uniform(ttl - SERVER_DEFAULTS.announce_interval_s, ttl), self._lapse, server)
        self._come_back_later(server)

    def _lapse(self, server: Server) -> None:
        if not server.alive:
            self._withdraw(server.sid)

    def _lose_sessions(self, server: Server) -> int:
        lost = len(server.holders)
        server.reset_sessions(self.limits)
        server.epoch += 1
        server.generating = server.training = 0
        return lost

    def _come_back_later(self, server: Server) -> None:
        pause = sc.lognormal_s(self.rng, self.scenario.downtime_median_h, sc.DOWNTIME_SIGMA)
        self.engine.after(pause, self.join, server)

    def _drain(self, server: Server, then: tuple[int, int] | None) -> None:
        """Take no new sessions; after drain_timeout_s close those still open; then leave, or load `then`."""
        self._set_serving(server, False)
        self._announce(server, ServerState.DRAINING)
        if server.check is not None:
            server.check.cancel()
        self.engine.after(SERVER_DEFAULTS.drain_timeout_s, self._drained, server, then, server.epoch)

    def _drained(self, server: Server, then: tuple[int, int] | None, epoch: int) -> None:
        if not server.alive or server.epoch != epoch:
            return
        lost = self._lose_sessions(server)
        if then is None:
            server.alive = False
            self._withdraw(server.sid)
            self._come_back_later(server)
            return
        self.metrics.interrupted_by_moves += lost
        server.start, server.end = then
        server.cache_capacity = self.scenario.cache_tokens * (server.end - server.start)
        self._announce(server, ServerState.JOINING)
        self.engine.after(self._load_s(server), self._online, server)

    def outage(self) -> None:
        """outage_share of the serving servers vanish at once (crashes)."""
        serving = [s for s in self.servers if s.serving]
        victims = self.rng.sample(serving, int(round(self.scenario.outage_share * len(serving))))
        for server in victims:
            self.crash(server)
        self.metrics.outage(self.engine.now, len(victims), self.uncovered == 0)

    # views for the bound

    def decode_bound(self) -> tuple[float, float, float]:
        """Upper bounds on the swarm's decode rate (tokens/s) from the serving servers' capacity, each at the batch
        its limits allow (sessions of the mean size its cache holds, at most MAX_BATCH): (the weakest block's total
        capacity, the total capacity over the number of blocks, the sessions every block can hold at once over the
        fastest per-token time a route could have)."""
        per_block = [0.0] * self.B
        slots = [0] * self.B
        fastest = [math.inf] * self.B  # the quickest step at each block, at its server's batch
        total = 0.0
        for s in self.servers:
            if not s.serving:
                continue
            held = min(self.scenario.max_sessions, int(self.scenario.cache_tokens // self.mean_session_tokens))
            batch = max(1, min(held, sc.MAX_BATCH))
            step = sc.batched_step_s(s.single_s, min(batch, DECODE_BATCH), s.batch_slope) * -(-batch // DECODE_BATCH)
            cap = batch / step  # block-tokens/s over its span: each of its blocks gets its share
            total += cap
            for b in range(s.start, s.end):
                per_block[b] += cap / (s.end - s.start)
                slots[b] += held
                fastest[b] = min(fastest[b], step)
        one_hop = self.scenario.hop_s + min(min(row) for row in self.scenario.rtt_ms) / 1000
        token_s = self.scenario.client_token_s + one_hop + sum(fastest)
        return min(per_block), total / self.B, min(slots) / token_s
