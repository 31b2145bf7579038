"""Fairness by host without sockets: whom a full pool is taken from, and the ledger's per-host shares, global caps and
reclaiming of idle holders."""

from __future__ import annotations

import asyncio

import pytest

from swarmlm.server.fairness import Holding, host_of, pick_victims
from swarmlm.server.peers import LimitError, PeerLedger, PeerLimits, PoolFull


def session(peer: str, host: str, active_at: float = 0.0, tokens: int = 10, busy: bool = False) -> Holding:
    return Holding(peer, host, lambda: None, active_at, busy=busy, sessions=1, tokens=tokens)


def test_host_of_names_the_remote_address() -> None:
    assert host_of("/ip4/203.0.113.7/tcp/31337") == "203.0.113.7"
    # one machine gets a whole /64: its addresses are one host
    one, other = host_of("/ip6/2001:db8:1:2:aaaa::1/tcp/1"), host_of("/ip6/2001:db8:1:2:bbbb::9/tcp/2")
    assert one == other == "2001:db8:1:2::/64"
    # a relayed peer counts to its relay's address
    relayed = "/ip4/198.51.100.1/tcp/4001/p2p/12D3KooWRelay/p2p-circuit"
    assert host_of(relayed) == "198.51.100.1"
    assert host_of("") == "unknown"


def test_the_richest_hosts_idle_holder_goes_first() -> None:
    crowd = [session(f"sybil{i}", "10.0.0.66", active_at=0.0) for i in range(6)]  # one host, many ids, all idle
    honest = session("honest", "10.0.0.1", active_at=0.0)
    victims = pick_victims([*crowd, honest], "sessions", "newcomer", "10.0.0.2", 1, host_only=False, now=10, idle_s=2)
    assert len(victims) == 1 and victims[0] in crowd


def test_idle_holders_go_before_active_ones_and_busy_ones_never() -> None:
    active = session("a", "10.0.0.66", active_at=9.5)
    idle = session("b", "10.0.0.66", active_at=1.0)
    busy = session("c", "10.0.0.66", active_at=0.0, busy=True)
    victims = pick_victims([active, idle, busy], "sessions", "new", "10.0.0.2", 2, host_only=False, now=10, idle_s=2)
    assert victims == [idle, active]


def test_only_richer_holders_are_taken_from() -> None:
    # the asker's host holds more than the other host, and no peer of its host more than the asker: nothing
    mine = [session("me", "10.0.0.2"), session("friend", "10.0.0.2"), session("friend", "10.0.0.2")]
    other = session("other", "10.0.0.3")
    assert pick_victims([*mine, other], "sessions", "friend", "10.0.0.2", 1, host_only=False, now=10, idle_s=2) == []
    # within its own host, a peer holding more than the asker is
    victims = pick_victims([*mine, other], "sessions", "new", "10.0.0.2", 1, host_only=False, now=10, idle_s=2)
    assert len(victims) == 1 and victims[0].peer == "friend"
    # host_only: a richer other host is not taken from when the asker's own host is over its share
    crowd = [session(f"s{i}", "10.0.0.66") for i in range(5)]
    assert pick_victims([*crowd, mine[0]], "sessions", "new", "10.0.0.2", 1, host_only=True, now=10, idle_s=2) == [
        mine[0]
    ]


def test_victims_cover_what_is_needed_counting_those_on_their_way() -> None:
    holders = [session(f"s{i}", "10.0.0.66", tokens=40) for i in range(5)]
    assert len(pick_victims(holders, "cache", "new", "10.0.0.2", 100, host_only=False, now=10, idle_s=2)) == 3
    holders[0].cutting = True
    assert len(pick_victims(holders, "cache", "new", "10.0.0.2", 100, host_only=False, now=10, idle_s=2)) == 2


LIMITS = PeerLimits(memory_bytes=100, sessions_per_peer=2, sessions_total=4, cache_share=0.5, streams_per_peer=3,
                    streams_total=6, host_share=0.5, reclaim_idle_s=1.0)  # fmt: skip


def test_streams_are_capped_per_peer_and_a_full_host_gives_up_its_idle_ones() -> None:
    async def scenario() -> None:
        ledger, cut = PeerLedger(LIMITS), []
        loop = asyncio.get_running_loop()
        sybil = [ledger.open_stream("s1", "/ip4/10.0.0.66/tcp/1", lambda: cut.append("s1")) for _ in range(3)]
        with pytest.raises(LimitError, match="3 streams"):
            ledger.open_stream("s1", "/ip4/10.0.0.66/tcp/1", lambda: None)
        for holding in sybil:
            holding.active_at = loop.time() - 5  # idle
        # the host holds its share (half of 6): a new id of that host takes an idle stream of the richest peer
        ledger.open_stream("s2", "/ip4/10.0.0.66/tcp/2", lambda: None)
        assert cut == ["s1"] and ledger.host_usage("10.0.0.66").streams == 3
        # another host is not limited by that host's share
        for _ in range(3):
            ledger.open_stream("h", "/ip4/10.0.0.1/tcp/1", lambda: None)
        assert ledger.total.streams == 6
        # the host is full, and no peer of it holds more than s1: refused
        with pytest.raises(LimitError, match="host holds 3 streams"):
            ledger.open_stream("s1", "/ip4/10.0.0.66/tcp/1", lambda: None)
        assert cut == ["s1"]

    asyncio.run(scenario())


def open_idle_session(ledger: PeerLedger, peer: str, closed: list[str]) -> Holding:
    """A session of `peer`, idle for 5 s, that ends at its next read when reclaimed (as InferenceSessions does)."""
    loop = asyncio.get_running_loop()
    ledger.open_session(peer)
    holding = ledger.hold(session(peer, ledger.host(peer), active_at=loop.time() - 5))

    def end() -> None:
        ledger.drop(holding)
        ledger.close_session(peer)
        closed.append(peer)

    holding.cut = lambda: loop.call_soon(end)
    return holding


def test_a_full_pool_reclaims_idle_sessions_of_the_richest_host_and_never_a_poorer_ones() -> None:
    async def scenario() -> None:
        ledger, closed = PeerLedger(LIMITS), []
        for peer, address in (("s1", "/ip4/10.0.0.66/tcp/1"), ("s2", "/ip4/10.0.0.66/tcp/2"),
                              ("s3", "/ip4/10.0.0.66/tcp/3"), ("honest", "/ip4/10.0.0.1/tcp/1"),
                              ("new", "/ip4/10.0.0.2/tcp/1"), ("late", "/ip4/10.0.0.3/tcp/1")):  # fmt: skip
            ledger.open_stream(peer, address, lambda: None)
        for peer in ("s1", "s2", "honest"):
            open_idle_session(ledger, peer, closed)
        with pytest.raises(PoolFull, match="host holds 2 sessions"):  # that host's share: 2 of 4
            ledger.open_session("s3")
        await ledger.admit_session("s3", timeout_s=1)  # one of the richer ids of its own host gives way
        assert len(closed) == 1 and closed[0] in ("s1", "s2")
        assert ledger.host_usage("10.0.0.66").sessions == 2 and ledger.total.sessions == 3
        ledger.close_session("s3")
        open_idle_session(ledger, "s3", closed)
        await ledger.admit_session("new", timeout_s=0)  # the last slot
        ledger.close_session("new")
        open_idle_session(ledger, "new", closed)
        await ledger.admit_session("late", timeout_s=1)  # the server is full: the richest host gives way
        assert len(closed) == 2 and closed[1] in ("s1", "s2", "s3") and ledger.host_usage("10.0.0.66").sessions == 1
        # the server is full, no host holds more than the asker's and no peer of its host more than the asker
        with pytest.raises(PoolFull, match="4 inference sessions"):
            await ledger.admit_session("new", timeout_s=0.1)
        assert "honest" not in closed and len(closed) == 2

    asyncio.run(scenario())


def test_buffered_bytes_are_capped_per_host_and_in_total() -> None:
    async def scenario() -> None:
        limits = PeerLimits(memory_bytes=100, sessions_per_peer=1, sessions_total=1, cache_share=1.0,
                            memory_total_bytes=300, host_share=0.5)  # fmt: skip
        ledger = PeerLedger(limits)
        for peer, address in (("s1", "/ip4/10.0.0.66/tcp/1"), ("s2", "/ip4/10.0.0.66/tcp/2"), ("h", "/ip4/10.0.0.1")):
            ledger.open_stream(peer, address, lambda: None)
        await ledger.acquire_bytes("s1", 100, timeout_s=0)
        await ledger.acquire_bytes("s2", 50, timeout_s=0)
        with pytest.raises(LimitError, match="host has 150 bytes"):  # its share is 150 of 300
            await ledger.acquire_bytes("s2", 10, timeout_s=0.05)
        await ledger.acquire_bytes("h", 100, timeout_s=0)  # another host is served meanwhile
        waiting = asyncio.create_task(ledger.acquire_bytes("s2", 40, timeout_s=1))
        await asyncio.sleep(0.01)
        ledger.release_bytes("s1", 100)
        await waiting
        assert ledger.host_usage("10.0.0.66").buffered_bytes == 90 and ledger.total.buffered_bytes == 190

    asyncio.run(scenario())


def test_a_live_session_of_the_richest_peer_goes_after_quieter_ones_of_its_host() -> None:
    """A session that stepped 50 ms ago is in the middle of an answer: a quiet session of the same (richer) host goes
    first, though its peer holds less, and the live one is taken only when nothing else can be."""
    live = [session("rich", "10.0.0.66", active_at=9.95) for _ in range(3)]
    quiet = session("other", "10.0.0.66", active_at=8.5)  # 1.5 s: not yet idle for 2 s, not in use either
    victims = pick_victims([*live, quiet], "sessions", "new", "10.0.0.2", 1, host_only=False, now=10, idle_s=2)
    assert victims == [quiet]
    victims = pick_victims([*live, quiet], "sessions", "new", "10.0.0.2", 2, host_only=False, now=10, idle_s=2)
    assert victims[0] is quiet and victims[1] in live
