"""Overload without sockets: the server's admission and its retry hint, the one route choice under busy answers and
cache room, and the client's SwarmBusyError once only busy servers are left."""

from __future__ import annotations

import asyncio
import random

import pytest

from swarmlm.client.health import busy_cool_down_s
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.config import ClientConfig
from swarmlm.errors import SwarmBusyError
from swarmlm.server.admission import (
    MAX_RETRY_AFTER_S,
    MIN_RETRY_AFTER_S,
    PRIOR_SESSION_S,
    SessionLengths,
    admit_now,
    retry_after_s,
)
from swarmlm.server.peers import PeerLedger, PeerLimits
from swarmlm.swarm.records import ServerRecord, ServerState
from swarmlm.swarm.route_choice import Knowledge, RouteRequest, choose_route, lacks_room
from swarmlm.swarm.routing import RouteSpan, ServerView

LIMITS = PeerLimits(memory_bytes=1 << 20, sessions_per_peer=2, sessions_total=3, cache_share=1.0, host_share=1.0)


def test_a_server_admits_up_to_its_slots_and_cache_then_refuses_as_busy() -> None:
    ledger = PeerLedger(LIMITS)
    assert admit_now(ledger, 0, 100, "a", 40) is None
    assert admit_now(ledger, 40, 100, "b", 40) is None
    refused = admit_now(ledger, 80, 100, "c", 40)  # no cache room left
    assert refused is not None and refused.error_kind == "busy" and ledger.sessions == 2
    assert admit_now(ledger, 80, 100, "c", 10) is None
    refused = admit_now(ledger, 90, 100, "d", 1)  # three sessions open: the slots are full
    assert refused is not None and refused.error_kind == "busy" and ledger.sessions == 3
    too_large = admit_now(PeerLedger(LIMITS), 0, 100, "e", 101)
    assert too_large is not None and too_large.error_kind == "too_large"


def test_the_retry_hint_is_the_mean_session_over_the_open_ones_bounded() -> None:
    assert retry_after_s(10, 100.0) == 10.0
    assert retry_after_s(1000, 100.0) == MIN_RETRY_AFTER_S
    assert retry_after_s(1, 1e9) == MAX_RETRY_AFTER_S
    lengths = SessionLengths(mean_s=100.0)
    for _ in range(50):
        lengths.end(20.0)
    assert 20.0 <= lengths.mean_s < 21.0 and lengths.retry_after_s(4) == pytest.approx(lengths.mean_s / 4)
    # a client bounds a server's hint: at least its base cool-down, at most busy_wait_s
    assert busy_cool_down_s(None, 1.0, 10.0) == 1.0
    assert busy_cool_down_s(0.01, 1.0, 10.0) == 1.0 and busy_cool_down_s(1e6, 1.0, 10.0) == 10.0


def test_the_first_sessions_replace_the_prior_at_once() -> None:
    # the prior (a chat of a few turns, 60 s) holds until a session ends; short sessions then give short hints at
    # once, not after twenty of them (a busy server hinted 30 s while its 2 s sessions freed a slot every second)
    lengths = SessionLengths()
    assert lengths.retry_after_s(2) == pytest.approx(PRIOR_SESSION_S / 2)
    lengths.end(2.0)
    assert lengths.mean_s == pytest.approx(2.0)
    for length in (3.0, 4.0):
        lengths.end(length)
    assert lengths.mean_s == pytest.approx(3.0)  # the mean of the three
    for _ in range(200):
        lengths.end(10.0)
    assert lengths.mean_s == pytest.approx(10.0)  # then a moving average that follows a change
    lengths.end(110.0)
    assert lengths.mean_s == pytest.approx(20.0)  # the newest session weighs 0.1


def _views() -> list[ServerView]:
    return [ServerView("full", 0, 4, 100.0, 0.01, cache_tokens_left=10), ServerView("roomy", 0, 4, 100.0, 0.05),
            ServerView("busy", 0, 4, 1000.0, 0.001)]  # fmt: skip


def test_the_route_avoids_busy_servers_and_those_without_cache_room() -> None:
    views, rng = _views(), random.Random(0)
    request = RouteRequest(0, 4, session_tokens=64)
    assert lacks_room(views[0], 64, 0, 4) and not lacks_room(views[0], 2, 0, 4)
    choice = choose_route(views, request, Knowledge(busy=frozenset({"busy"})), rng)
    assert choice is not None and choice.route == [RouteSpan("roomy", 0, 4)]
    # announcements lag: when only servers looking full are left, they are asked all the same
    alone = choose_route(views[:1], request, Knowledge(), rng)
    assert alone is not None and alone.route == [RouteSpan("full", 0, 4)]
    # only busy servers: no route (the caller waits, then tells its user the swarm is full)
    assert choose_route(views[2:], request, Knowledge(busy=frozenset({"busy"})), rng) is None


def test_exploring_goes_through_a_never_measured_server_once_it_is_time() -> None:
    views = [ServerView("known", 0, 4, 100.0, 0.01), ServerView("new", 0, 4, 100.0, 0.2)]
    known = Knowledge(unmeasured=frozenset({"new"}), explore=True)
    choice = choose_route(views, RouteRequest(0, 4), known, random.Random(0))
    assert choice is not None and choice.explored == "new" and choice.route == [RouteSpan("new", 0, 4)]
    plain = choose_route(views, RouteRequest(0, 4), Knowledge(unmeasured=frozenset({"new"})), random.Random(0))
    assert plain is not None and plain.explored is None and plain.route == [RouteSpan("known", 0, 4)]


def _record() -> ServerRecord:
    return ServerRecord(state=ServerState.ONLINE, start=0, end=4, throughput=100.0, dtype="float32")


def test_the_client_says_the_swarm_is_full_after_busy_wait_s_with_a_retry_hint() -> None:
    config = ClientConfig(missing_blocks_timeout_s=5.0, busy_wait_s=0.3)
    manager = SequenceManager(config, "test", num_blocks=4)
    manager.view.update({"a": _record(), "b": _record()})
    manager.refresh = _no_refresh  # type: ignore[method-assign]
    manager.cool_down("a", "busy", retry_after_s=0.2)  # at least ban_base_s (1 s): a hint cannot make it hammer
    assert [span.peer_id for span in asyncio.run(manager.make_route(0, 4))] == ["b"]
    manager.cool_down("b", "busy", retry_after_s=5.0)  # at most max(ban_base_s, busy_wait_s)
    with pytest.raises(SwarmBusyError) as caught:
        asyncio.run(manager.make_route(0, 4, session_tokens=64))
    error = caught.value
    assert 0.3 <= error.waited_s < 2.0 and 0 < error.retry_after_s <= 1.0 and "swarm is full" in str(error)


async def _no_refresh() -> None:
    return None
