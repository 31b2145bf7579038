"""Unit tests of route planning over a swarm of servers that each serve a contiguous span of blocks."""

import math
import random
from collections.abc import Callable

import pytest

from swarmlm.swarm.routing import (
    DEFAULT_HOP_COST_S,
    DEFAULT_LATENCY_S,
    THROUGHPUT_HOP_SHARE,
    RouteSpan,
    ServerView,
    find_route,
    missing_blocks,
    policy_for,
)


def _sv(peer_id: str, start: int, end: int, throughput: float = 1000.0, latency_s: float | None = None) -> ServerView:
    return ServerView(peer_id, start, end, throughput, latency_s)


def _hop_cost(server: ServerView, blocks: int, tokens: int) -> float:
    latency = DEFAULT_LATENCY_S if server.latency_s is None else server.latency_s
    return DEFAULT_HOP_COST_S + latency + blocks * tokens / server.throughput


def _route_cost(servers: list[ServerView], route: list[RouteSpan], tokens: int) -> float:
    # A test swarm has one record per peer, so each hop's server is found by its id.
    by_peer = {s.peer_id: s for s in servers}
    return sum(_hop_cost(by_peer[hop.peer_id], hop.end - hop.start, tokens) for hop in route)


def _reference_cost(servers: list[ServerView], start: int, end: int, banned: set[str], tokens: int) -> float:
    """Cheapest route cost by brute force over every (origin, server, target): slow but obviously right."""
    best = [math.inf] * (end + 1)
    best[start] = 0.0
    for i in range(start, end):
        if math.isinf(best[i]):
            continue
        for s in servers:
            if s.peer_id in banned or not s.start <= i < s.end:
                continue
            for j in range(i + 1, min(s.end, end) + 1):
                best[j] = min(best[j], best[i] + _hop_cost(s, j - i, tokens))
    return best[end]


def _check_route_shape(servers: list[ServerView], route: list[RouteSpan], start: int, end: int, banned: set[str]):
    by_peer = {s.peer_id: s for s in servers}
    position = start
    for index, hop in enumerate(route):
        assert hop.start == position, f"gap or overlap at {position}: {route}"
        assert hop.start < hop.end
        assert hop.peer_id not in banned
        server = by_peer[hop.peer_id]
        assert server.start <= hop.start and hop.end <= server.end, f"{hop} outside {server}"
        if index:
            assert route[index - 1].peer_id != hop.peer_id, f"unmerged consecutive hops: {route}"
        position = hop.end
    assert position == end


def test_one_server_covering_all() -> None:
    assert find_route([_sv("a", 0, 32)], 0, 32) == [RouteSpan("a", 0, 32)]


def test_two_servers_splitting() -> None:
    servers = [_sv("b", 16, 32), _sv("a", 0, 16)]
    assert find_route(servers, 0, 32) == [RouteSpan("a", 0, 16), RouteSpan("b", 16, 32)]


def test_three_servers_in_a_chain() -> None:
    servers = [_sv("c", 20, 30), _sv("a", 0, 10), _sv("b", 10, 20)]
    assert find_route(servers, 0, 30) == [RouteSpan("a", 0, 10), RouteSpan("b", 10, 20), RouteSpan("c", 20, 30)]


def test_overlap_prefers_two_hops_over_three() -> None:
    # a,b,c chain the range in three hops; a + wide (10:30) does it in two.
    servers = [_sv("a", 0, 10), _sv("b", 10, 20), _sv("c", 20, 30), _sv("wide", 5, 30)]
    route = find_route(servers, 0, 30)
    assert route is not None and len(route) == 2
    assert route[0].peer_id == "a" and route[1] == RouteSpan("wide", route[0].end, 30)


def test_overlapping_servers_split_inside_spans() -> None:
    route = find_route([_sv("a", 0, 20), _sv("b", 10, 30)], 0, 30)
    assert route is not None and [hop.peer_id for hop in route] == ["a", "b"]
    assert route[0].start == 0 and route[0].end == route[1].start and route[1].end == 30
    assert 10 <= route[0].end <= 20


def test_banned_replica_picks_the_other() -> None:
    servers = [_sv("a", 0, 10), _sv("b", 0, 10)]
    assert find_route(servers, 0, 10, banned={"a"}) == [RouteSpan("b", 0, 10)]
    assert find_route(servers, 0, 10, banned=["b"]) == [RouteSpan("a", 0, 10)]
    assert find_route(servers, 0, 10, banned=("a", "b")) is None


def test_uncovered_block_gives_none_and_is_reported() -> None:
    servers = [_sv("a", 0, 4), _sv("b", 5, 10)]
    assert find_route(servers, 0, 10) is None
    assert missing_blocks(servers, 0, 10) == [4]
    assert missing_blocks(servers, 0, 10, banned={"b"}) == [4, 5, 6, 7, 8, 9]
    assert missing_blocks(servers, 5, 10) == []
    assert missing_blocks([], 2, 5) == [2, 3, 4]


def test_lower_latency_wins_between_equal_hop_routes() -> None:
    servers = [_sv("far", 0, 10, latency_s=0.2), _sv("near", 0, 10, latency_s=0.01)]
    assert find_route(servers, 0, 10) == [RouteSpan("near", 0, 10)]
    # Two 2-hop routes: the one through nearer servers wins.
    servers = [
        _sv("a1", 0, 5, latency_s=0.05),
        _sv("a2", 5, 10, latency_s=0.05),
        _sv("b1", 0, 5, latency_s=0.02),
        _sv("b2", 5, 10, latency_s=0.02),
    ]
    assert find_route(servers, 0, 10) == [RouteSpan("b1", 0, 5), RouteSpan("b2", 5, 10)]


def test_unknown_latency_assumes_the_default() -> None:
    servers = [_sv("unknown", 0, 10), _sv("measured", 0, 10, latency_s=DEFAULT_LATENCY_S * 2)]
    assert find_route(servers, 0, 10) == [RouteSpan("unknown", 0, 10)]


def test_much_faster_server_wins_for_large_inputs() -> None:
    servers = [
        _sv("near", 0, 10, throughput=1000.0, latency_s=0.01),
        _sv("fast", 0, 10, throughput=1e5, latency_s=0.2),
    ]
    assert find_route(servers, 0, 10, tokens=1) == [RouteSpan("near", 0, 10)]
    assert find_route(servers, 0, 10, tokens=2000) == [RouteSpan("fast", 0, 10)]


def test_fast_server_takes_over_inside_an_overlap_for_large_inputs() -> None:
    # For one token the single hop on slow wins; for many tokens it pays to leave slow as soon as fast can take over.
    servers = [
        _sv("slow", 0, 20, throughput=1000.0, latency_s=0.01),
        _sv("fast", 10, 20, throughput=1e5, latency_s=0.01),
    ]
    assert find_route(servers, 0, 20, tokens=1) == [RouteSpan("slow", 0, 20)]
    assert find_route(servers, 0, 20, tokens=1000) == [RouteSpan("slow", 0, 10), RouteSpan("fast", 10, 20)]


def test_rng_breaks_ties_between_replicas() -> None:
    servers = [_sv("a", 0, 10), _sv("b", 0, 10), _sv("c", 0, 10, latency_s=1.0)]
    chosen = {find_route(servers, 0, 10, rng=random.Random(seed))[0].peer_id for seed in range(64)}
    assert chosen == {"a", "b"}
    # The same seed gives the same choice.
    assert find_route(servers, 0, 10, rng=random.Random(7)) == find_route(servers, 0, 10, rng=random.Random(7))


def test_no_rng_is_deterministic_whatever_the_input_order() -> None:
    servers = [_sv(f"p{k}", 0, 10) for k in range(8)] + [_sv(f"q{k}", 10, 20) for k in range(8)]
    expected = find_route(servers, 0, 20)
    assert expected == [RouteSpan("p0", 0, 10), RouteSpan("q0", 10, 20)]
    shuffler = random.Random(0)
    for _ in range(10):
        shuffler.shuffle(servers)
        assert find_route(servers, 0, 20) == expected


def test_subrange_routing() -> None:
    servers = [_sv("a", 0, 10), _sv("b", 10, 20)]
    assert find_route(servers, 7, 13) == [RouteSpan("a", 7, 10), RouteSpan("b", 10, 13)]
    assert find_route(servers, 12, 15) == [RouteSpan("b", 12, 15)]
    assert find_route([_sv("a", 0, 10), _sv("c", 13, 20)], 7, 13) is None
    assert missing_blocks([_sv("a", 0, 10), _sv("c", 13, 20)], 7, 13) == [10, 11, 12]


def test_consecutive_hops_on_one_peer_are_merged() -> None:
    # One peer announcing two adjacent spans is reached in a single hop.
    assert find_route([_sv("a", 0, 5), _sv("a", 5, 10)], 0, 10) == [RouteSpan("a", 0, 10)]


def test_unusable_servers_are_ignored_consistently() -> None:
    servers = [_sv("zero", 0, 10, throughput=0.0), _sv("nan", 0, 10, throughput=math.nan), _sv("empty", 3, 3)]
    assert find_route(servers, 0, 10) is None
    assert missing_blocks(servers, 0, 10) == list(range(10))


def test_empty_range_and_invalid_arguments() -> None:
    assert find_route([], 5, 5) == []
    assert find_route([_sv("a", 0, 10)], 0, 0) == []
    assert missing_blocks([], 5, 5) == []
    for start, end in [(5, 4), (-1, 3), (-3, -1)]:
        with pytest.raises(ValueError):
            find_route([_sv("a", 0, 10)], start, end)
        with pytest.raises(ValueError):
            missing_blocks([_sv("a", 0, 10)], start, end)
    with pytest.raises(ValueError):
        find_route([_sv("a", 0, 10)], 0, 10, tokens=-1)


def _random_swarm(rnd: random.Random, num_blocks: int) -> list[ServerView]:
    servers = []
    for k in range(rnd.randint(0, 10)):
        lo = rnd.randrange(num_blocks)
        hi = rnd.randint(lo + 1, num_blocks)
        latency = rnd.choice([None, rnd.uniform(0.0, 0.3), 0.05])
        throughput = rnd.choice([1000.0, rnd.uniform(10.0, 5000.0)])
        servers.append(ServerView(f"peer{k}", lo, hi, throughput, latency))
    return servers


@pytest.mark.parametrize("seed", range(400))
def test_random_swarms_route_is_exact_cover_and_cheapest(seed: int) -> None:
    rnd = random.Random(seed)
    num_blocks = rnd.randint(1, 30)
    servers = _random_swarm(rnd, num_blocks)
    start = rnd.randrange(num_blocks)
    end = rnd.randint(start, num_blocks)
    banned = {s.peer_id for s in servers if rnd.random() < 0.2}
    tokens = rnd.choice([1, 16, 4096])
    missing = missing_blocks(servers, start, end, banned=banned)
    assert missing == sorted(set(missing)) and all(start <= b < end for b in missing)
    for rng in (None, random.Random(seed)):
        route = find_route(servers, start, end, banned=banned, tokens=tokens, rng=rng)
        if missing:
            assert route is None
            continue
        assert route is not None
        _check_route_shape(servers, route, start, end, banned)
        best = _reference_cost(servers, start, end, banned, tokens)
        assert _route_cost(servers, route, tokens) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_announced_throughputs_are_bounded_by_the_median() -> None:
    from swarmlm.swarm.routing import MAX_PRIOR_FACTOR, bounded_priors

    assert bounded_priors([1000.0, 1e12, 900.0]) == [1000.0, MAX_PRIOR_FACTOR * 1000.0, 900.0]
    # with two servers the lower median is used: the liar cannot raise the cap itself
    assert bounded_priors([1000.0, 1e12]) == [1000.0, MAX_PRIOR_FACTOR * 1000.0]
    assert bounded_priors([]) == []
    assert bounded_priors([float("nan"), 5.0])[1] == 5.0


# Routing policies: latency for inference sessions, throughput for batch work.


def _brute_force(
    servers: list[ServerView], start: int, end: int, banned: set[str], tokens: int, hop: Callable[[ServerView], float]
) -> float:
    """Cheapest route cost by brute force when a hop on s costs hop(s) plus its blocks' compute of `tokens` tokens."""
    best = [math.inf] * (end + 1)
    best[start] = 0.0
    for i in range(start, end):
        for s in servers:
            if s.peer_id in banned or not s.start <= i < s.end or math.isinf(best[i]):
                continue
            for j in range(i + 1, min(s.end, end) + 1):
                best[j] = min(best[j], best[i] + hop(s) + (j - i) * tokens / s.throughput)
    return best[end]


def _throughput_hop(
    servers: list[ServerView], start: int, end: int, banned: set[str], tokens: int
) -> Callable[[ServerView], float]:
    """The hop cost of the throughput policy for requests costed as `tokens` tokens: overhead, round trip, traffic."""
    traffic = THROUGHPUT_HOP_SHARE * _brute_force(servers, start, end, banned, tokens, lambda s: 0.0)
    return lambda s: _hop_cost(s, 0, tokens) + traffic


def test_auto_routing_is_latency_for_inference_and_throughput_for_batch_work() -> None:
    assert policy_for("auto", inference=True) == "latency"
    assert policy_for("auto", inference=False) == "throughput"
    for policy in ("latency", "throughput"):
        assert policy_for(policy, inference=True) == policy_for(policy, inference=False) == policy
    with pytest.raises(ValueError, match="routing must be one of"):
        policy_for("fastest", inference=False)


def test_fast_far_server_wins_throughput_and_near_slow_halves_win_latency() -> None:
    servers = [
        _sv("far", 0, 10, throughput=4000.0, latency_s=0.2),
        _sv("near1", 0, 5, throughput=1000.0, latency_s=0.005),
        _sv("near2", 5, 10, throughput=1000.0, latency_s=0.005),
    ]
    halves = [RouteSpan("near1", 0, 5), RouteSpan("near2", 5, 10)]
    assert find_route(servers, 0, 10, policy="latency") == halves
    assert find_route(servers, 0, 10, policy="throughput") == [RouteSpan("far", 0, 10)]


def test_slow_whole_server_wins_latency_and_fast_halves_win_throughput() -> None:
    # all equally near: for one token a hop costs more than the compute the fast halves save
    servers = [
        _sv("slow", 0, 10, throughput=4000.0, latency_s=0.01),
        _sv("fast1", 0, 5, throughput=16000.0, latency_s=0.01),
        _sv("fast2", 5, 10, throughput=16000.0, latency_s=0.01),
    ]
    halves = [RouteSpan("fast1", 0, 5), RouteSpan("fast2", 5, 10)]
    assert find_route(servers, 0, 10, tokens=1, policy="latency") == [RouteSpan("slow", 0, 10)]
    assert find_route(servers, 0, 10, tokens=4096, policy="latency") == halves  # large enough, latency agrees
    # throughput costs every request as a full one: small requests take the same route as large ones
    for tokens in (0, 1, 4096):
        assert find_route(servers, 0, 10, tokens=tokens, policy="throughput") == halves
    # ... full for this client: one whose requests are one token long routes them like latency (plus traffic)
    assert find_route(servers, 0, 10, policy="throughput", full_tokens=1) == [RouteSpan("slow", 0, 10)]


def test_throughput_takes_an_extra_hop_only_for_more_than_its_share() -> None:
    # compute c (whole) against c / r (halves), each hop also a share of the least compute, c / r:
    # the halves win iff c - c / r > share * c / r (plus 5 ms), about iff r > 1 + share
    for ratio, first in ((1 + THROUGHPUT_HOP_SHARE / 2, "whole"), (1 + THROUGHPUT_HOP_SHARE * 2, "half1")):
        servers = [
            _sv("whole", 0, 10, throughput=1000.0, latency_s=0.0),
            _sv("half1", 0, 5, throughput=1000.0 * ratio, latency_s=0.0),
            _sv("half2", 5, 10, throughput=1000.0 * ratio, latency_s=0.0),
        ]
        route = find_route(servers, 0, 10, policy="throughput")
        assert route is not None and route[0].peer_id == first, (ratio, route)


def test_throughput_draws_among_replicas_without_cutting_them() -> None:
    # a route through both replicas costs a hop more, which its traffic puts beyond the tie tolerance
    servers = [_sv("a", 0, 30, throughput=1000.0), _sv("b", 0, 30, throughput=1000.0)]
    routes = [
        find_route(servers, 0, 30, rng=random.Random(seed), tie_tolerance=0.05, policy="throughput")
        for seed in range(64)
    ]
    assert {tuple(route or ()) for route in routes} == {(RouteSpan("a", 0, 30),), (RouteSpan("b", 0, 30),)}


def test_throughput_prefers_the_nearer_of_like_servers_and_weighs_load() -> None:
    near_far = [_sv("far", 0, 10, throughput=1e5, latency_s=0.2), _sv("near", 0, 10, throughput=1e5, latency_s=0.01)]
    for seed in range(16):
        route = find_route(near_far, 0, 10, rng=random.Random(seed), tie_tolerance=0.05, policy="throughput")
        assert route == [RouteSpan("near", 0, 10)]
    # a busy server's throughput is shared: twice the speed at full load is no better than an idle server
    busy = ServerView("busy", 0, 10, throughput=3000.0, latency_s=0.01, load=1.0)
    assert find_route([busy, _sv("idle", 0, 10, 2000.0, 0.01)], 0, 10, policy="throughput")[0].peer_id == "idle"
    assert find_route([busy, _sv("idle", 0, 10, 1000.0, 0.01)], 0, 10, policy="throughput")[0].peer_id == "busy"


@pytest.mark.parametrize("seed", range(200))
def test_random_swarms_throughput_route_is_exact_cover_and_cheapest(seed: int) -> None:
    rnd = random.Random(seed)
    num_blocks = rnd.randint(1, 30)
    servers = _random_swarm(rnd, num_blocks)
    start = rnd.randrange(num_blocks)
    end = rnd.randint(start, num_blocks)
    banned = {s.peer_id for s in servers if rnd.random() < 0.2}
    tokens, full = rnd.choice([1, 16, 4096]), rnd.choice([1, 1024])
    missing = missing_blocks(servers, start, end, banned=banned)
    for rng in (None, random.Random(seed)):
        route = find_route(
            servers, start, end, banned=banned, tokens=tokens, rng=rng, policy="throughput", full_tokens=full
        )
        if missing:
            assert route is None
            continue
        assert route is not None
        _check_route_shape(servers, route, start, end, banned)
        costed = max(tokens, full)
        hop = _throughput_hop(servers, start, end, banned, costed)
        by_peer = {s.peer_id: s for s in servers}
        cost = sum(hop(by_peer[h.peer_id]) + (h.end - h.start) * costed / by_peer[h.peer_id].throughput for h in route)
        best = _brute_force(servers, start, end, banned, costed, hop)
        # with the default tie tolerance (0) a drawn route is a cheapest one too
        assert cost == pytest.approx(best, rel=1e-9, abs=1e-12)
