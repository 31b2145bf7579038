"""Unit tests of load-aware routing: near-ties spread clients, stickiness, announced load and full caches."""

import asyncio
import math
import random
from collections import Counter

import pytest

from swarmlm.client.health import Health
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.swarm_view import SESSION_LOAD, ServerFilter, SwarmView, announced_load
from swarmlm.config import ClientConfig
from swarmlm.swarm.records import ServerRecord, ServerState
from swarmlm.swarm.routing import MAX_LOAD_FACTOR, RouteSpan, ServerView, find_route

TOL, STICKY = 0.05, 0.2


def _replicas(latencies: list[float], load: float = 0.0) -> list[ServerView]:
    """A first span on "head" and replicas r0, r1, ... of the second span with the given measured round trips."""
    head = ServerView("head", 0, 4, 1000.0, 0.01)
    return [head] + [ServerView(f"r{k}", 4, 8, 1000.0, lat, load) for k, lat in enumerate(latencies)]


def _second_hop(route: list[RouteSpan] | None) -> str:
    assert route is not None and [(h.start, h.end) for h in route] == [(0, 4), (4, 8)]
    return route[1].peer_id


def test_routes_within_the_tolerance_spread_over_replicas_across_clients() -> None:
    # measured round trips differing by jitter (a few percent) must not pin every client to the same replica
    servers = _replicas([0.0100, 0.0103, 0.0098])
    chosen = Counter(
        _second_hop(find_route(servers, 0, 8, rng=random.Random(c), tie_tolerance=TOL)) for c in range(300)
    )
    assert set(chosen) == {"r0", "r1", "r2"}
    assert min(chosen.values()) > 60  # roughly a third each
    # without a tolerance the measured-cheapest replica takes every client
    exact = {_second_hop(find_route(servers, 0, 8, rng=random.Random(c))) for c in range(50)}
    assert exact == {"r2"}


def test_a_replica_outside_the_tolerance_is_never_drawn() -> None:
    servers = _replicas([0.010, 0.010, 0.030])
    chosen = {_second_hop(find_route(servers, 0, 8, rng=random.Random(c), tie_tolerance=TOL)) for c in range(200)}
    assert chosen == {"r0", "r1"}


@pytest.mark.parametrize("seed", range(100))
def test_drawn_routes_cost_at_most_the_tolerance_more_than_the_cheapest(seed: int) -> None:
    rnd = random.Random(seed)
    servers = [
        ServerView(f"p{k}", lo, rnd.randint(lo + 1, 12), rnd.uniform(500, 1500), rnd.uniform(0.005, 0.05))
        for k, lo in enumerate(rnd.randrange(12) for _ in range(12))
    ] + [ServerView("all", 0, 12, 1000.0, 0.2)]

    def cost(route: list[RouteSpan]) -> float:
        by_peer = {s.peer_id: s for s in servers}
        return sum(
            0.005 + by_peer[h.peer_id].latency_s + (h.end - h.start) * 8 / by_peer[h.peer_id].throughput for h in route
        )

    best = find_route(servers, 0, 12, tokens=8)
    drawn = find_route(servers, 0, 12, tokens=8, rng=rnd, tie_tolerance=TOL)
    assert best is not None and drawn is not None
    assert cost(drawn) <= cost(best) * (1 + TOL) + 1e-12


def test_stickiness_keeps_the_previous_replica_under_small_noise() -> None:
    rnd = random.Random(0)
    previous = "r1"
    for _ in range(200):
        # r1 is up to 15% more expensive than the best of the others in this measurement: within the margin
        servers = _replicas(
            [0.010 * rnd.uniform(0.9, 1.1), 0.010 * rnd.uniform(1.0, 1.15), 0.010 * rnd.uniform(0.9, 1.1)]
        )
        route = find_route(servers, 0, 8, rng=rnd, tie_tolerance=TOL, prefer={previous, "head"}, stickiness=STICKY)
        assert _second_hop(route) == previous


def test_stickiness_lets_go_when_another_replica_becomes_much_cheaper() -> None:
    servers = _replicas([0.010, 0.030])  # r1 now three times as expensive as r0
    for c in range(50):
        route = find_route(servers, 0, 8, rng=random.Random(c), tie_tolerance=TOL, prefer={"r1"}, stickiness=STICKY)
        assert _second_hop(route) == "r0"


def test_without_preference_clients_flip_between_near_equal_replicas() -> None:
    # what stickiness prevents: the same client drawing anew each request moves between replicas
    servers = _replicas([0.010, 0.0101])
    rnd = random.Random(0)
    assert len({_second_hop(find_route(servers, 0, 8, rng=rnd, tie_tolerance=TOL)) for _ in range(40)}) == 2


def test_load_only_ever_increases_a_cost() -> None:
    idle = _replicas([0.010, 0.010])
    # a server claiming a negative (or NaN) load does not look better than measured: still a tie with r0
    for bogus in (-5.0, -0.5, math.nan):
        servers = [idle[0], idle[1], ServerView("r1", 4, 8, 1000.0, 0.010, bogus)]
        chosen = {_second_hop(find_route(servers, 0, 8, rng=random.Random(c))) for c in range(50)}
        assert chosen == {"r0", "r1"}
    # a loaded server loses to an idle one of equal measurements
    busy = [idle[0], idle[1], ServerView("r1", 4, 8, 1000.0, 0.010, 0.3)]
    assert {_second_hop(find_route(busy, 0, 8, rng=random.Random(c))) for c in range(50)} == {"r0"}


def test_load_is_bounded() -> None:
    # whatever load a server claims, it costs at most 1 + MAX_LOAD_FACTOR times its measured cost: a much nearer
    # server stays preferred over a far idle one
    near = ServerView("near", 0, 8, 1000.0, 0.010, load=1e9)
    far = ServerView("far", 0, 8, 1000.0, 0.010 * (2 + MAX_LOAD_FACTOR) * 2)
    assert find_route([near, far], 0, 8) == [RouteSpan("near", 0, 8)]


def _record(sessions: int = 0, left: int | None = None) -> ServerRecord:
    return ServerRecord(
        state=ServerState.ONLINE, start=0, end=4, throughput=100.0, dtype="float32",
        cache_tokens_total=4096, cache_tokens_left=left, sessions_open=sessions,
    )  # fmt: skip


def test_records_without_load_fields_still_parse() -> None:
    old = {"state": "online", "start": 0, "end": 4, "throughput": 10.0, "dtype": "float32"}
    record = ServerRecord.model_validate(old)
    assert record.sessions_open == 0 and record.cache_tokens_left is None and announced_load(record) == 0.0
    assert announced_load(_record(sessions=3)) == pytest.approx(3 * SESSION_LOAD)


def test_a_full_server_is_skipped_for_sessions_but_not_for_forward() -> None:
    view = SwarmView(ServerFilter.of(None, ["float32"]))
    view.update({"full": _record(left=100), "roomy": _record(left=4096), "silent": _record(left=None)})
    # free cache is announced in block-tokens: a session needs its batch x max_length tokens at each block it may use
    assert view.full_for(2 * 64, 0, 4) == {"full"}  # 128 tokens at 4 blocks do not fit in 100 free block-tokens
    assert view.full_for(25, 0, 4) == set()
    assert view.full_for(26, 0, 4) == {"full"}
    assert view.full_for(50, 2, 8) == set()  # the servers hold 2 of the blocks 2:8
    assert view.full_for(1000, 4, 8) == set()  # they hold none of those: they are not asked
    # for forward (no session) nothing is excluded: routing still sees every server
    assert {v.peer_id for v in view.views(Health(1.0, 60.0))} == {"full", "roomy", "silent"}


def _manager(records: dict[str, ServerRecord]) -> SequenceManager:
    manager = SequenceManager(ClientConfig(missing_blocks_timeout_s=0.0), "test", num_blocks=4)
    manager.view.update(records)
    return manager


def test_sessions_open_on_servers_with_room_and_forwards_go_anywhere() -> None:
    manager = _manager({"full": _record(left=100), "roomy": _record(left=4096)})
    for _ in range(20):
        route = asyncio.run(manager.make_route(0, 4, tokens=2, session_tokens=2 * 64))
        assert route == [RouteSpan("roomy", 0, 4)]
    forward_peers = set()
    for _ in range(40):
        fresh = _manager({"full": _record(left=100), "roomy": _record(left=4096)})  # no stickiness across clients
        forward_peers.add(asyncio.run(fresh.make_route(0, 4, tokens=2))[0].peer_id)
    assert forward_peers == {"full", "roomy"}
    # announcements lag: when every server looks full the servers themselves decide (one may have freed room)
    crowded = _manager({"full": _record(left=100)})
    assert asyncio.run(crowded.make_route(0, 4, tokens=2, session_tokens=2 * 64)) == [RouteSpan("full", 0, 4)]


def test_the_manager_keeps_the_replica_it_used_last() -> None:
    manager = _manager({"a": _record(), "b": _record()})
    first = asyncio.run(manager.make_route(0, 4))
    assert all(asyncio.run(manager.make_route(0, 4)) == first for _ in range(30))


def test_a_failed_or_busy_server_loses_its_preference() -> None:
    manager = _manager({"a": _record(), "b": _record()})
    for avoid in (manager.ban, manager.cool_down):
        first = asyncio.run(manager.make_route(0, 4))[0].peer_id
        assert first in manager._last_used
        avoid(first, "test")
        assert first not in manager._last_used  # once its ban or cool-down is over it is a plain candidate again
