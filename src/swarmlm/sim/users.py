"""The two kinds of simulated users: chat sessions (prefill, then decode steps) and training jobs (forward and
backward over long batches). Steps of a few tokens are one event; latency is computed per token."""

from __future__ import annotations

from swarmlm.sim import scenario as sc
from swarmlm.sim.clients import TOKEN_BYTES, Client, Router, Session, hop_rtt_s
from swarmlm.sim.metrics import Metrics
from swarmlm.sim.world import World
from swarmlm.swarm.routing import Policy


class ChatSession(Session):
    """A conversation: one inference session kept open over its turns (prompt, answer, think time)."""

    def __init__(self, client: Client, chat: sc.Chat, world: World, router: Router, metrics: Metrics):
        super().__init__(client, world, router, metrics)
        self.chat, self.turn, self.remaining = chat, 0, 0
        self.step_tokens = world.scenario.step_tokens

    def session_tokens(self) -> int:
        return self.chat.max_length

    def begin(self) -> None:
        self.metrics.chats_started += 1
        self.client.explored_at = self.engine.now  # a client explores once it has run for explore_interval_s
        self.open("prefill")

    def admitted(self) -> None:
        self.metrics.chats_admitted += 1

    def prefill(self) -> None:
        if not self.check("prefill"):
            return
        prompt, answer, _ = self.chat.turns[self.turn]
        duration = sum(hop_rtt_s(self.world.scenario, self.client, hop) + prompt * TOKEN_BYTES / hop.server.net_bps
                       + prompt * (hop.end - hop.start) / hop.server.throughput for hop in self.hops)  # fmt: skip
        self.history += prompt
        self.remaining = answer
        self.engine.after(duration, self.step)

    def step(self) -> None:
        if not self.check("step"):
            return
        tokens = min(self.step_tokens, self.remaining)
        for hop in self.hops:  # first: this session's step is part of the batch it is costed at
            hop.server.generating += 1
        per_token = self.world.scenario.client_token_s + sum(
            hop_rtt_s(self.world.scenario, self.client, hop)
            + TOKEN_BYTES / hop.server.net_bps
            + hop.server.step_s(hop.end - hop.start)
            for hop in self.hops
        )
        self.engine.after(tokens * per_token, self._stepped, tokens, per_token)

    def _stepped(self, tokens: int, per_token: float) -> None:
        for hop in self.hops:
            if not hop.lost:
                hop.server.generating = max(0, hop.server.generating - 1)
                self.client.measured.add(hop.server.sid)
        self.metrics.generated(tokens, per_token, self.client.region)
        self.history += tokens
        self.remaining -= tokens
        if self.remaining > 0:
            self.step()
            return
        self.turn += 1
        if self.turn < len(self.chat.turns):
            self.engine.after(self.chat.turns[self.turn - 1][2], self.prefill)
            return
        self.metrics.chats_done += 1
        self.metrics.last_chat_done = self.engine.now
        self.close()


class TrainingJob(Session):
    """Forward and backward passes of sc.TRAIN_TOKENS-token batches until its time is up; stateless, so a lost
    span is re-routed and its step run again (no replay)."""

    policy: Policy = "throughput"

    def __init__(self, client: Client, duration_s: float, world: World, router: Router, metrics: Metrics):
        super().__init__(client, world, router, metrics)
        self.duration_s = duration_s
        self.end_t = 0.0

    def tokens(self) -> int:
        return sc.TRAIN_TOKENS

    def begin(self) -> None:
        self.end_t = self.engine.now + self.duration_s
        self.open("step")

    def step(self) -> None:
        if self.engine.now >= self.end_t:
            self.close()
            return
        if not self.check("step"):
            self.metrics.train_failures += 1
            return
        tokens = sc.TRAIN_TOKENS
        duration = sum(
            hop_rtt_s(self.world.scenario, self.client, hop)
            + 2 * tokens * TOKEN_BYTES / hop.server.net_bps
            + sc.TRAIN_PASSES * tokens * (hop.end - hop.start) / hop.server.throughput * (1 + hop.server.training)
            for hop in self.hops
        )
        for hop in self.hops:
            hop.server.training += 1
        self.engine.after(duration, self._stepped)

    def _stepped(self) -> None:
        for hop in self.hops:
            if not hop.lost:
                hop.server.training = max(0, hop.server.training - 1)
        self.metrics.train_steps += 1
        self.step()
