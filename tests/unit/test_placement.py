"""Block selection as pure functions of a swarm view: where a new server goes, who keeps a contested span, when
a server moves."""

from __future__ import annotations

import pytest

from swarmlm.config import ServerConfig
from swarmlm.errors import SwarmError
from swarmlm.server.placement import (
    block_throughputs,
    choose_span,
    claimed_first,
    estimate_throughput,
    requested_span,
    should_move,
)
from swarmlm.swarm.records import ServerRecord, ServerState

# Ed25519-looking peer ids are not needed here: placement never checks them
A, B, C, ME = "peer-a", "peer-b", "peer-c", "peer-me"


def record(
    start: int, end: int, throughput: float = 10.0, state: ServerState = ServerState.ONLINE, since: float = 0.0
) -> ServerRecord:
    return ServerRecord(state=state, start=start, end=end, throughput=throughput, dtype="float32", since=since)


def test_an_empty_swarm_starts_at_block_zero() -> None:
    assert choose_span(7, 3, {}) == (0, 3)
    assert choose_span(7, 7, {}) == (0, 7)


def test_a_gap_is_filled_first() -> None:
    assert choose_span(7, 3, {A: record(0, 3)}) == (3, 6)
    assert choose_span(7, 3, {A: record(0, 3), B: record(3, 6)}) == (4, 7)  # the window with the uncovered block
    assert choose_span(7, 2, {A: record(0, 2), B: record(4, 7)}) == (2, 4)


def test_the_weakest_blocks_are_chosen_and_only_serving_servers_count() -> None:
    servers = {A: record(0, 4, throughput=50.0), B: record(3, 7, throughput=10.0)}
    assert choose_span(7, 3, servers) == (4, 7)
    servers[C] = record(4, 7, throughput=100.0, state=ServerState.JOINING)  # joining counts: it is coming
    assert choose_span(7, 3, servers) == (0, 3)
    for state in (ServerState.OFFLINE, ServerState.DRAINING):
        assert choose_span(7, 3, {A: record(0, 3, state=state)}) == (0, 3)  # leaving servers do not count


def test_ties_go_to_the_lowest_index_and_the_own_record_is_ignored() -> None:
    assert choose_span(6, 2, {A: record(0, 6)}) == (0, 2)
    assert choose_span(7, 3, {ME: record(0, 3), A: record(3, 7)}, me=ME) == (0, 3)
    assert block_throughputs(3, {A: record(0, 2, 5.0), B: record(1, 3, 2.0)}) == [5.0, 7.0, 2.0]


def test_a_contested_span_is_kept_by_the_earliest_claim() -> None:
    mine = record(0, 3, state=ServerState.JOINING, since=5.0)
    assert claimed_first(ME, mine, {A: record(0, 3, state=ServerState.JOINING, since=4.0)})
    assert not claimed_first(ME, mine, {A: record(0, 3, state=ServerState.JOINING, since=6.0)})
    # same time: the lower peer id keeps it, whichever of the two computes it
    rival = record(0, 3, state=ServerState.JOINING, since=5.0)
    assert claimed_first(ME, mine, {A: rival}) != claimed_first(A, rival, {ME: mine})
    assert not claimed_first(ME, mine, {A: record(0, 4, state=ServerState.JOINING, since=1.0)})  # another span
    assert not claimed_first(ME, mine, {A: record(0, 3, since=1.0)})  # a replica online already was chosen with


def test_a_joining_server_estimates_its_throughput_from_the_swarm() -> None:
    assert estimate_throughput({}) == 1.0
    assert estimate_throughput({A: record(0, 3, 10.0), B: record(0, 3, 30.0)}) == 20.0


def test_a_server_moves_to_fill_a_gap() -> None:
    servers = {ME: record(0, 4), A: record(0, 4)}  # blocks 4:7 lost their server
    assert should_move(7, ME, servers, quality=0.75) == (3, 7)


def test_a_server_stays_when_moving_gains_too_little_or_nothing() -> None:
    assert should_move(7, ME, {ME: record(0, 4), A: record(3, 7)}, quality=0.75) is None  # already its best
    # two 3-block servers cannot cover 7 blocks: the bottleneck is 0 either way, so nobody moves back and forth
    assert should_move(7, ME, {ME: record(3, 6), A: record(4, 7)}, quality=0.75) is None
    balanced = {ME: record(0, 4, 10.0), A: record(3, 7, 10.0), B: record(0, 4, 9.0), C: record(3, 7, 11.0)}
    assert should_move(7, ME, balanced, quality=0.75) is None
    weak = {ME: record(0, 4, 10.0), A: record(3, 7, 1.0), B: record(0, 4, 10.0)}
    assert should_move(7, ME, weak, quality=0.75) == (3, 7)
    assert should_move(7, ME, weak, quality=0.05) is None


def test_a_span_larger_than_the_model_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot place"):
        choose_span(3, 4, {})


def test_the_requested_span_is_checked_against_the_model() -> None:
    assert requested_span(ServerConfig(model="m", start_block=2, end_block=5), 7) == (2, 5)
    assert requested_span(ServerConfig(model="m", num_blocks=3), 7) == (0, 3)  # until the swarm is read
    with pytest.raises(SwarmError, match="--num-blocks 8"):
        requested_span(ServerConfig(model="m", num_blocks=8), 7)
    with pytest.raises(SwarmError, match="outside the model"):
        requested_span(ServerConfig(model="m", start_block=5, end_block=9), 7)
