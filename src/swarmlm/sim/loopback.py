"""The simulator on a small fixed swarm: the aggregate decode rate it predicts for sessions started at once on
servers of given spans, and what an overloaded one does (users arriving one after another, more than the servers'
session slots), from measured per-step costs (tests and bench/overload.py compare them with a real loopback swarm)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from swarmlm.server.peers import PeerLimits
from swarmlm.sim import scenario as sc
from swarmlm.sim.clients import Client
from swarmlm.sim.metrics import Metrics
from swarmlm.sim.simulation import Simulation
from swarmlm.sim.users import ChatSession
from swarmlm.sim.world import PEER_BYTES, World

# prefill of a one-token prompt: negligible next to the decode steps measured
PROMPT_TOKENS = 1
# loading the fixed servers takes simulated time; sessions start once all are online
START_AFTER_S = 3600.0
# loopback moves hidden states at memory speed: their transfer is part of the measured hop cost
LOOPBACK_BYTES_PER_S = 1e12


@dataclass(frozen=True)
class StepCosts:
    """Measured costs of a decode step: per block for one session, its growth per extra session, per hop, and the
    client's own per token."""

    block_s: float
    batch_slope: float
    hop_s: float
    client_s: float


def predicted_rate(spans: Sequence[tuple[int, int]], users: int, new_tokens: int, costs: StepCosts) -> float:
    """Tokens/s of `users` sessions generating new_tokens each, all at once, on servers serving `spans` (one region,
    no round trip beyond costs.hop_s): the simulator's batched step model and routing on a loopback swarm."""
    sim = _loopback(spans, costs)
    chats = [ChatSession(Client(i, 0, random.Random(i)), sc.Chat(((PROMPT_TOKENS, new_tokens, 0.0),)), sim.world,
                         sim.router, sim.metrics) for i in range(users)]  # fmt: skip
    for chat in chats:
        chat.begin()
    sim.engine.run(START_AFTER_S * 2)
    if sim.metrics.chats_done != users or sim.metrics.last_chat_done is None:
        raise RuntimeError(f"only {sim.metrics.chats_done} of {users} simulated sessions finished")
    return users * new_tokens / (sim.metrics.last_chat_done - START_AFTER_S)


def _loopback(
    spans: Sequence[tuple[int, int]],
    costs: StepCosts,
    max_sessions: int = sc.MAX_SESSIONS,
    cache_tokens: int = sc.CACHE_TOKENS_PER_BLOCK,
    limits: PeerLimits | None = None,
) -> Simulation:
    """A simulation of servers on `spans` in one region, online at START_AFTER_S, with the costs measured; limits:
    the servers' session limits per peer and host (None: the server's defaults)."""
    scenario = sc.Scenario(servers=len(spans), clients=0, num_blocks=max(end for _, end in spans), outage_hour=None,
                           uptime_median_h=1e6, region_shares=(1.0,), rtt_ms=((0.0,),), hop_s=costs.hop_s,
                           client_token_s=costs.client_s, batch_slope=costs.batch_slope, step_tokens=1,
                           rebalance_interval_s=0.0, max_sessions=max_sessions, cache_tokens=cache_tokens)  # fmt: skip
    sim = Simulation(scenario)
    if limits is not None:  # before the servers join: they take the world's limits then
        sim.world.limits = limits
    for server, (start, end) in zip(sim.world.servers, spans, strict=True):
        server.n, server.single_s, server.net_bps = end - start, costs.block_s, LOOPBACK_BYTES_PER_S
        sim.world.join(server, (start, end))
    sim.engine.run(START_AFTER_S)
    return sim


@dataclass(frozen=True)
class Overload:
    """Users arriving every arrival_s, each generating new_tokens greedily after a prompt of prompt_tokens, all
    through one client (one peer of one host, as loopback users are), on servers with `slots` session slots each
    and cache_tokens per block (enough for the slots: the slots are the binding limit)."""

    spans: tuple[tuple[int, int], ...]
    slots: int
    users: int
    arrival_s: float
    prompt_tokens: int
    new_tokens: int
    cache_tokens: int

    def limits(self) -> PeerLimits:
        """The servers' limits, as `serve --max-sessions slots --max-sessions-per-peer users --host-share 1
        --peer-cache-share 1` sets them: one peer may take every slot."""
        return PeerLimits(PEER_BYTES, sessions_per_peer=self.users, sessions_total=self.slots, cache_share=1.0,
                          host_share=1.0)  # fmt: skip


@dataclass
class UserOutcome:
    """One user's session: the times its tokens came (admitted), or when it was refused (both from its arrival)."""

    arrived_s: float
    token_times_s: list[float] = field(default_factory=list)
    refused_after_s: float | None = None

    def tokens_per_s(self) -> float | None:
        """Its decode rate, first token to last (the open, the prefill and the wait for a slot are left out)."""
        times = self.token_times_s
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None


class _TimedChat(ChatSession):
    """A chat session that notes when each of its tokens came and when it was refused."""

    def __init__(self, client: Client, chat: sc.Chat, world: World, metrics: Metrics, sim: Simulation):
        super().__init__(client, chat, world, sim.router, metrics)
        self.outcome = UserOutcome(arrived_s=0.0)

    def begin(self) -> None:
        self.outcome.arrived_s = self.engine.now
        super().begin()

    def _stepped(self, tokens: int, per_token: float) -> None:
        self.outcome.token_times_s.append(self.engine.now - self.outcome.arrived_s)
        super()._stepped(tokens, per_token)

    def close(self) -> None:
        if not self.was_admitted and self.outcome.refused_after_s is None:
            self.outcome.refused_after_s = self.engine.now - self.outcome.arrived_s
        super().close()


def simulated_overload(overload: Overload, costs: StepCosts) -> list[UserOutcome]:
    """What each user of `overload` gets in the simulator: the real admission (server/admission.py), busy retry
    hints, the client's cool-downs and busy_wait_s, and route choice, with the batched step costs measured."""
    sim = _loopback(overload.spans, costs, overload.slots, overload.cache_tokens, overload.limits())
    client = Client(0, 0, random.Random(0))  # one client for every user: its busy cool-downs are shared, as here
    chat = sc.Chat(((overload.prompt_tokens, overload.new_tokens, 0.0),))
    users = [_TimedChat(client, chat, sim.world, sim.metrics, sim) for _ in range(overload.users)]
    for i, user in enumerate(users):
        sim.engine.at(START_AFTER_S + i * overload.arrival_s, user.begin)
    sim.engine.run(START_AFTER_S * 2)
    unfinished = overload.users - sim.metrics.chats_done - sim.metrics.refused
    if unfinished:
        raise RuntimeError(f"{unfinished} of {overload.users} simulated users neither finished nor were refused")
    return [user.outcome for user in users]
