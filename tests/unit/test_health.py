"""Unit tests of the client's own measurements and of the swarm view: what routing sees of each server."""

import random

import pytest

from swarmlm.client.health import Health
from swarmlm.client.swarm_view import ServerFilter, SwarmView
from swarmlm.protocol.messages import PROTOCOL_VERSION
from swarmlm.swarm.records import ServerRecord, ServerState
from swarmlm.swarm.routing import find_route

DTYPES = ("float32", "bfloat16", "float16")


def _record(start: int = 0, end: int = 4, throughput: float = 1000.0, **fields: object) -> ServerRecord:
    values = dict(state=ServerState.ONLINE, start=start, end=end, throughput=throughput, dtype="float32")
    values.update({"fingerprint": "fp", **fields})
    return ServerRecord(**values)


def test_fit_reproduces_measured_times_and_learns_the_slope() -> None:
    health = Health(1.0, 60.0)
    for _ in range(20):
        health.record_success("a", 0.010 + 2 * 0.001, work=2)  # 10 ms per call + 1 ms per block-token
        health.record_success("a", 0.010 + 200 * 0.001, work=200)
    latency, throughput = health.measured("a", prior_throughput=1e9)
    assert latency == pytest.approx(0.010, rel=0.05) and throughput == pytest.approx(1000.0, rel=0.05)
    assert health.measured("never-called", 1000.0) is None


def test_same_sized_calls_keep_their_measured_total_whatever_the_prior() -> None:
    health = Health(1.0, 60.0)
    for _ in range(5):
        health.record_success("liar", 0.5, work=4)
    for prior in (1.0, 1000.0, 1e12):
        latency, throughput = health.measured("liar", prior)
        assert latency + 4 / throughput == pytest.approx(0.5, rel=1e-6) or latency == 0.0


def test_an_absurd_announcement_does_not_take_routes_once_measured() -> None:
    # "fast" announces an absurd throughput but is slow in fact; "honest" announces and delivers 1000 tokens/s
    view = SwarmView(ServerFilter.of("fp", DTYPES))
    view.update({"fast": _record(throughput=1e12), "honest": _record(throughput=1000.0)})
    health = Health(1.0, 60.0)
    rng = random.Random(0)
    # before measuring, the claim counts for at most MAX_PRIOR_FACTOR x the median: a bounded advantage
    assert find_route(view.views(health), 0, 4, tokens=8, rng=rng)[0].peer_id == "fast"
    health.record_success("fast", 2.0, work=4 * 8)  # measured by the client: 2 s per call
    health.record_success("honest", 0.05, work=4 * 8)
    for tokens in (1, 8, 64):
        assert find_route(view.views(health), 0, 4, tokens=tokens, rng=rng)[0].peer_id == "honest"


@pytest.mark.parametrize("policy", ["latency", "throughput"])
def test_what_was_never_measured_never_outranks_what_was(policy: str) -> None:
    """Thirteen records of free keys claim a billion tokens/s (the median claim, so not even bounded): once the client
    measured the honest servers, the fakes count as no faster and no nearer than the slowest and farthest of them,
    so no route prefers them, whatever the policy or request size."""
    view = SwarmView(ServerFilter.of("fp", DTYPES))
    fakes = {f"fake{i}": _record(throughput=1e9) for i in range(13)}
    view.update({**fakes, "a": _record(throughput=800.0), "b": _record(0, 2, throughput=900.0)})
    health = Health(1.0, 60.0)
    health.record_success("a", 0.3, work=4 * 8)
    health.record_success("b", 0.1, work=2 * 8)
    views = {v.peer_id: v for v in view.views(health)}
    slowest = min(views["a"].throughput, views["b"].throughput)
    farthest = max(views["a"].latency_s or 0.0, views["b"].latency_s or 0.0)
    for fake in fakes:
        assert views[fake].throughput <= slowest and (views[fake].latency_s or 0.0) >= farthest
    for tokens in (1, 64, 1024):
        route = find_route(list(views.values()), 0, 4, tokens=tokens, policy=policy)
        assert {span.peer_id for span in route} <= {"a", "b"}


def test_a_server_that_does_not_answer_a_ping_is_avoided_and_never_explored_until_it_answers() -> None:
    health = Health(1.0, 60.0)
    assert health.answered("x")
    assert health.record_unanswered_ping("x", 2.0) == 1.0  # banned like a failure
    assert "x" in health.banned() and not health.answered("x") and health.knows_latency("x")
    assert health.unreachable("x") == 2.0  # and again: the ban doubles
    health.record_ping("x", 0.01)
    assert health.answered("x")
    health.unreachable("y")
    health.record_success("y", 0.1, work=1)
    assert health.answered("y") and "y" not in health.banned()


def test_bans_double_and_clear_on_success() -> None:
    health = Health(1.0, 3.0)
    assert [health.ban("a") for _ in range(4)] == [1.0, 2.0, 3.0, 3.0]
    assert health.banned() == {"a"} and health.failed("a")
    health.record_success("a", 0.1, work=1)
    assert health.banned() == set() and not health.failed("a")


def test_swarm_view_uses_only_acceptable_servers() -> None:
    records = {
        "good": _record(),
        "other-model": _record(fingerprint="another"),
        "old-protocol": _record(protocol_version=PROTOCOL_VERSION + 1),
        "int8": _record(dtype="int8"),
        "offline": _record(state=ServerState.OFFLINE),
        "blocked": _record(),
    }
    view = SwarmView(ServerFilter.of("fp", DTYPES, blocked=["blocked"]))
    view.update(records)
    assert set(view.servers) == {"good"}
    allow = SwarmView(ServerFilter.of("fp", DTYPES, allowed=["blocked"]))
    allow.update(records)
    assert set(allow.servers) == {"blocked"}
    only_bf16 = SwarmView(ServerFilter.of("fp", ("bfloat16",)))
    only_bf16.update(records)
    assert only_bf16.servers == {}


def test_records_reject_unparseable_or_absurd_fields() -> None:
    with pytest.raises(ValueError):
        _record(addrs=("not a multiaddr",))
    with pytest.raises(ValueError):
        _record(throughput=float("inf"))
    assert _record(addrs=("/ip4/127.0.0.1/tcp/5/p2p/12D3KooWDf9GRMVkcnVvVHdchPAgxFQeyJ36RABKeb3P1LGtMwje",)).addrs


def test_pinged_round_trips_route_to_the_near_replica_before_any_call() -> None:
    view = SwarmView(ServerFilter.of("fp", DTYPES))
    view.update({"near": _record(), "far": _record()})
    health = Health(1.0, 60.0)
    health.record_ping("near", 0.012)
    health.record_ping("far", 0.205)
    health.record_ping("far", float("nan"))  # garbage is ignored
    assert not health.has_measured("near") and health.knows_latency("far")
    rng = random.Random(0)
    for _ in range(20):  # random tie-breaking would pick "far" half the time if they looked equal
        assert find_route(view.views(health), 0, 4, tokens=1, rng=rng, tie_tolerance=0.05)[0].peer_id == "near"
    # once called, the calls' own timing is what counts
    health.record_success("far", 0.001, 4)
    assert health.measured("far", 1000.0)[0] < 0.01


def test_pings_that_differ_by_jitter_only_leave_replicas_tied() -> None:
    view = SwarmView(ServerFilter.of("fp", DTYPES))
    view.update({"a": _record(), "b": _record()})
    health = Health(1.0, 60.0)
    health.record_ping("a", 0.0011)
    health.record_ping("b", 0.0013)
    rng = random.Random(0)
    picks = {find_route(view.views(health), 0, 4, rng=rng, tie_tolerance=0.05)[0].peer_id for _ in range(20)}
    assert picks == {"a", "b"}  # load still spreads over both
