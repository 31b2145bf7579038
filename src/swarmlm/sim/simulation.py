"""One run of a scenario: the world, its users and the samples, driven by the event engine."""

from __future__ import annotations

import random
from collections.abc import Callable

from swarmlm.sim import scenario as sc
from swarmlm.sim.clients import Client, Router
from swarmlm.sim.engine import Engine
from swarmlm.sim.metrics import Metrics, Sample
from swarmlm.sim.users import ChatSession, TrainingJob
from swarmlm.sim.world import World


class Simulation:
    def __init__(self, scenario: sc.Scenario):
        self.scenario = scenario
        self.rng = random.Random(scenario.seed)
        self.engine = Engine()
        self.metrics = Metrics()
        self.world = World(scenario, self.engine, random.Random(self.rng.random()), self.metrics)
        self.router = Router(self.world)
        self.chats: list[ChatSession] = []

    def _users(self) -> None:
        rng = random.Random(self.rng.random())
        trainers = round(self.scenario.clients * self.scenario.training_share)
        for cid in range(self.scenario.clients):
            client = Client(cid, sc.pick(rng, self.scenario.region_shares), random.Random(rng.random()))
            arrival = sc.diurnal_time(rng, self.scenario.hours)
            if cid < trainers:
                duration = sc.lognormal_s(rng, sc.TRAIN_MEDIAN_H, sc.TRAIN_SIGMA)
                job = TrainingJob(client, duration, self.world, self.router, self.metrics)
                self.engine.at(arrival, job.begin)
            else:
                chat = ChatSession(client, sc.draw_chat(rng), self.world, self.router, self.metrics)
                self.chats.append(chat)
                self.engine.at(arrival, chat.begin)
        if self.chats:  # the bound counts the sessions a cache holds at the chats' mean size
            self.world.mean_session_tokens = sum(c.chat.max_length for c in self.chats) / len(self.chats)

    def _sample(self) -> None:
        m, period = self.metrics, self.scenario.sample_s
        block, total, slots = self.world.decode_bound()
        open_chats = sum(1 for chat in self.chats if chat.hops)
        serving = sum(1 for s in self.world.servers if s.serving)
        m.samples.append(Sample(self.engine.now, m.tokens / period, block, total, slots, serving, open_chats,
                                list(self.world.cover)))  # fmt: skip
        m.tokens = 0
        self.engine.after(period, self._sample)

    def run(self, progress: Callable[[float], None] | None = None) -> Metrics:
        """Run the whole scenario; progress(simulated seconds) after each sample."""
        self.world.start()
        self._users()
        self.engine.after(self.scenario.sample_s, self._sample)
        end = self.scenario.hours * 3600
        hour = 3600.0
        t = 0.0
        while t < end:
            t = min(end, t + hour)
            self.engine.run(t)
            if progress is not None:
                progress(t)
        self.metrics.close(end)
        return self.metrics
