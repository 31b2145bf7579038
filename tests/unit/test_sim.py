"""The simulator's parts: the event engine (order, cancellation), the world (coverage, crashes, record lapse) and a
chat session's failover, on small hand-built swarms."""

from __future__ import annotations

import random

import pytest

from swarmlm.sim import scenario as sc
from swarmlm.sim.clients import Client
from swarmlm.sim.engine import Engine
from swarmlm.sim.report import dumps, report, weighted_percentiles
from swarmlm.sim.simulation import Simulation
from swarmlm.sim.users import ChatSession
from swarmlm.sim.world import SERVER_DEFAULTS

# a GPU that holds exactly two blocks of the simulated model (its memory past the reserve fits two, not three)
TWO_BLOCKS = sc.Gpu("two-block test GPU", 1.0, sc.RESERVED_GB + 2.5 * sc.block_gb(), 1000, 100, 1000)


def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    engine = Engine()
    seen: list[str] = []
    engine.at(2.0, seen.append, "late")
    engine.at(1.0, seen.append, "first")
    engine.at(1.0, seen.append, "second")
    engine.after(0.5, seen.append, "earliest")
    engine.run(10.0)
    assert seen == ["earliest", "first", "second", "late"]
    assert engine.now == 10.0


def test_a_cancelled_event_never_runs_and_later_events_wait_for_their_time() -> None:
    engine = Engine()
    seen: list[str] = []
    engine.at(1.0, seen.append, "cancelled").cancel()
    engine.at(5.0, seen.append, "later")
    engine.run(4.0)
    assert seen == [] and engine.now == 4.0
    engine.run(5.0)
    assert seen == ["later"]


def test_an_event_scheduled_by_an_event_runs_at_its_own_time() -> None:
    engine = Engine()
    seen: list[float] = []
    engine.at(1.0, lambda: engine.after(2.0, lambda: seen.append(engine.now)))
    engine.run(10.0)
    assert seen == [3.0]
    with pytest.raises(ValueError, match="in the past"):
        engine.after(-1.0, seen.append, 0)


def small(servers: int, **kw: object) -> Simulation:
    scenario = sc.Scenario(
        servers=servers, clients=0, num_blocks=4, gpus=(TWO_BLOCKS,), outage_hour=None, uptime_median_h=1e4, **kw
    )  # type: ignore[arg-type]
    return Simulation(scenario)


def start_all(sim: Simulation) -> None:
    for i, server in enumerate(sim.world.servers):
        sim.engine.at(i, sim.world.join, server)  # one after another: each sees the others' claims
    sim.engine.run(200.0)


def test_joining_servers_cover_the_model_and_a_crash_uncovers_its_blocks_until_its_record_lapses() -> None:
    sim = small(2)
    start_all(sim)
    world = sim.world
    assert sorted((s.start, s.end) for s in world.servers) == [(0, 2), (2, 4)]
    assert world.uncovered == 0 and len(world.records) == 2
    victim = world.servers[1]
    world.crash(victim)
    assert world.uncovered == 2
    assert victim.sid in world.records  # others still read its record: it lapses after record_ttl_s
    sim.engine.run(sim.engine.now + SERVER_DEFAULTS.record_ttl_s + 0.1)
    assert victim.sid not in world.records


def test_coverage_time_counts_only_the_time_every_block_is_served() -> None:
    sim = small(2)
    start_all(sim)
    covered_from = sim.metrics._since
    sim.world.crash(sim.world.servers[0])
    crash_t = sim.engine.now
    sim.engine.run(crash_t + 100)
    sim.metrics.close(sim.engine.now)
    assert sim.metrics.covered_s == pytest.approx(crash_t - covered_from)


def test_a_chat_survives_the_crash_of_a_server_on_its_route_by_rebuilding_the_span_and_replaying() -> None:
    sim = small(4)
    start_all(sim)
    client = Client(0, 0, random.Random(0))
    chat = ChatSession(client, sc.Chat(((100, 200, 1.0),)), sim.world, sim.router, sim.metrics)
    sim.engine.at(sim.engine.now, chat.begin)
    sim.engine.run(sim.engine.now + 5.0)
    assert chat.hops and 0 < sim.metrics.tokens_total < 200
    victim = chat.hops[-1].server
    sim.world.crash(victim)
    sim.engine.run(sim.engine.now + 600.0)
    m = sim.metrics
    assert (m.chats_done, m.tokens_total, m.recoveries) == (1, 200, 1)
    assert m.replayed_tokens >= 100  # at least the prompt was replayed onto the new server
    assert victim.sid in client.bans and victim not in [hop.server for hop in chat.hops]


def test_a_chat_fails_for_good_only_after_waiting_for_missing_blocks() -> None:
    sim = small(2)
    start_all(sim)
    sim.world.crash(sim.world.servers[1])
    client = Client(0, 0, random.Random(0))
    chat = ChatSession(client, sc.Chat(((10, 10, 1.0),)), sim.world, sim.router, sim.metrics)
    sim.engine.at(sim.engine.now + 60, chat.begin)  # after the record lapsed: no route at all
    sim.engine.run(sim.engine.now + 200)
    assert (sim.metrics.failed_uncovered, sim.metrics.failed_covered, sim.metrics.chats_done) == (1, 0, 0)


def test_the_same_seed_gives_the_same_report_and_another_seed_another() -> None:
    def run(seed: int) -> str:
        scenario = sc.Scenario(servers=30, clients=60, hours=1.0, seed=seed, outage_hour=0.5, sample_s=600)
        return dumps(report(scenario, {"swarmlm": Simulation(scenario).run()}))

    first = run(0)
    assert first == run(0)
    assert first != run(1)


def test_weighted_percentiles_count_each_value_by_its_weight() -> None:
    import numpy as np

    values, weights = np.array([3.0, 1.0, 2.0]), np.array([1, 8, 1])
    assert weighted_percentiles(values, weights, (50, 95, 99)) == [1.0, 3.0, 3.0]
    assert weighted_percentiles(values[:0], weights[:0], (50,)) is None


def test_a_simulated_client_bans_a_failing_server_as_the_client_does_doubling_up_to_the_cap() -> None:
    client = Client(0, 0, random.Random(0))
    lengths = []
    for _ in range(9):
        client.ban("s1", now=100.0)
        lengths.append(client.bans["s1"][0] - 100.0)
    assert lengths == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]  # ClientConfig: ban_base_s 1, ban_max_s 60
