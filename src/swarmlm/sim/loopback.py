"""The simulator on a small fixed swarm: the aggregate decode rate it predicts for sessions started at once on
servers of given spans, from measured per-step costs (tests compare it with a real loopback swarm)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from swarmlm.sim import scenario as sc
from swarmlm.sim.clients import Client
from swarmlm.sim.simulation import Simulation
from swarmlm.sim.users import ChatSession

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
    scenario = sc.Scenario(servers=len(spans), clients=0, num_blocks=max(end for _, end in spans), outage_hour=None,
                           uptime_median_h=1e6, region_shares=(1.0,), rtt_ms=((0.0,),), hop_s=costs.hop_s,
                           client_token_s=costs.client_s, batch_slope=costs.batch_slope, step_tokens=1,
                           rebalance_interval_s=0.0)  # fmt: skip
    sim = Simulation(scenario)
    for server, (start, end) in zip(sim.world.servers, spans, strict=True):
        server.n, server.single_s, server.net_bps = end - start, costs.block_s, LOOPBACK_BYTES_PER_S
        sim.world.join(server, (start, end))
    sim.engine.run(START_AFTER_S)
    chats = [ChatSession(Client(i, 0, random.Random(i)), sc.Chat(((PROMPT_TOKENS, new_tokens, 0.0),)), sim.world,
                         sim.router, sim.metrics) for i in range(users)]  # fmt: skip
    for chat in chats:
        chat.begin()
    sim.engine.run(START_AFTER_S * 2)
    if sim.metrics.chats_done != users or sim.metrics.last_chat_done is None:
        raise RuntimeError(f"only {sim.metrics.chats_done} of {users} simulated sessions finished")
    return users * new_tokens / (sim.metrics.last_chat_done - START_AFTER_S)
