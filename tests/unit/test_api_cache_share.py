"""The API's cache shared between its users (api/cache_share.py) as pure decisions and as a ledger on an event loop,
and who a user is (api/app.py: the key presented, else the client's address)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from swarmlm.api.app import USER_KEY, address_user, api_key_check, key_user, user_of
from swarmlm.api.cache_share import CacheBusyError, CacheLedger, decide, fair_share, swarm_budget
from swarmlm.api.schemas import ApiError
from swarmlm.cli.main import API_KEY_ENV, api_keys


def test_a_lone_user_may_fill_the_budget_but_not_pass_it() -> None:
    assert decide([("a", 500, False)], [("a", 500)], 1024).grant == [0]  # nobody else wants the room
    waits = decide([("a", 1000, False)], [("a", 500)], 1024)
    assert waits.grant == [] and waits.pause == []  # its own sessions are never paused for its own growth


def test_a_newcomer_to_a_full_budget_pauses_the_largest_holders_session() -> None:
    leases = [("flood", 300, False), ("flood", 510, False), ("other", 200, False)]
    decision = decide(leases, [("honest", 40)], 1024)
    assert decision.grant == [] and decision.pause == [1]  # flood holds 810 of a share of 341: its largest goes
    # once paused, its room is on its way back: nothing more is paused for the same waiter
    leases[1] = ("flood", 510, True)
    assert decide(leases, [("honest", 40)], 1024).pause == []
    # a user within its share is never paused, however full the budget
    assert decide([("a", 300, False), ("b", 700, False)], [("c", 100)], 1000).pause == [1]
    assert decide([("a", 330, False), ("b", 330, False), ("c", 330, False)], [("c", 100)], 1000).pause == []


def test_a_user_above_its_share_waits_while_room_is_short_and_grows_into_spare_room() -> None:
    leases = [("a", 600, False), ("b", 100, False)]
    assert decide(leases, [("a", 400)], 1024).grant == []  # above its share of 512 and no room: it waits
    assert decide(leases, [("a", 400)], 1024).pause == []  # and takes nothing from b
    assert decide(leases, [("a", 300)], 1024).grant == [0]  # room nobody waits for is not left idle


def test_waiters_holding_least_go_first_and_an_entitled_one_is_not_overtaken() -> None:
    assert decide([("a", 500, False)], [("a", 100), ("b", 100)], 650).grant == [1]
    # c (entitled, blocked) waits for room being made: the smaller d behind it, holding more, does not take it
    decision = decide([("a", 900, False), ("d", 50, False)], [("c", 100), ("d", 60)], 1024)
    assert decision.grant == [] and decision.pause == [0]


def test_the_fair_share_divides_the_budget_among_users_with_requests() -> None:
    assert fair_share(1024, 1) == 1024 and fair_share(1024, 3) == 341 and fair_share(1024, 0) == 1024


def test_the_budget_is_one_peers_share_of_the_roomiest_server_at_the_tightest_block() -> None:
    # two servers of 15 blocks each with 2048 tokens of cache (block-tokens: x15): one peer may hold half
    assert swarm_budget([(0, 15, 2048 * 15), (15, 30, 2048 * 15)], 30) == 1024
    # a replica of blocks 0:15 with a larger cache does not raise the bound of blocks 15:30
    assert swarm_budget([(0, 15, 2048 * 15), (0, 15, 8192 * 15), (15, 30, 2048 * 15)], 30) == 1024
    assert swarm_budget([(0, 15, 2048 * 15)], 30) == 0  # a block without a server: unknown
    assert swarm_budget([(0, 30, 4096 * 30)], 30, share=0.25) == 1024


def test_the_ledger_pauses_the_flooder_for_a_newcomer_and_gives_the_room_back() -> None:
    async def run() -> None:
        ledger = CacheLedger(lambda: 1024, wait_s=5.0)
        first = await ledger.acquire("flood", 510)
        second = await ledger.acquire("flood", 510)
        assert ledger.held("flood") == 1020
        honest = asyncio.create_task(ledger.acquire("honest", 40))
        await asyncio.sleep(0)
        assert not honest.done() and [first.paused, second.paused].count(True) == 1
        paused = first if first.paused else second
        ledger.release(paused)  # the paused request closed its session
        lease = await asyncio.wait_for(honest, 1.0)
        resume = asyncio.create_task(ledger.acquire("flood", 500))  # no room while honest holds its own
        await asyncio.sleep(0)
        assert not resume.done() and not lease.paused  # honest, within its share, is never paused
        ledger.release(lease)
        assert (await asyncio.wait_for(resume, 1.0)).tokens == 500
        assert ledger.held("flood") == 1010 and ledger.held("honest") == 0

    asyncio.run(run())


def test_a_wait_for_room_has_a_deadline_and_an_unknown_budget_bounds_nothing() -> None:
    async def run() -> None:
        ledger = CacheLedger(lambda: 100, wait_s=0.05)
        held = await ledger.acquire("a", 100)
        with pytest.raises(CacheBusyError):
            await ledger.acquire("a", 10)
        assert ledger.held("a") == 100 and not ledger._waiting
        ledger.release(held)
        ledger.release(held)  # twice is harmless
        assert ledger.held("a") == 0
        unbounded = CacheLedger(lambda: None, wait_s=0.05)
        assert (await unbounded.acquire("a", 10**9)).tokens == 10**9

    asyncio.run(run())


def test_a_user_is_the_key_presented_else_the_address_never_the_body() -> None:
    async def run() -> None:
        middleware = api_key_check(("sk-one", "sk-two"))
        seen: list[str] = []

        async def handler(request: web.Request) -> web.Response:
            seen.append(user_of(request))
            return web.Response()

        for key in ("sk-one", "sk-two", "sk-one"):
            request = make_mocked_request("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"})
            await middleware(request, handler)
        assert seen == [key_user("sk-one"), key_user("sk-two"), key_user("sk-one")]
        assert seen[0] != seen[1] and "sk-one" not in seen[0]
        with pytest.raises(ApiError):
            await middleware(make_mocked_request("POST", "/v1/completions",
                                                 headers={"Authorization": "Bearer sk-three"}), handler)  # fmt: skip
        unkeyed = make_mocked_request("POST", "/v1/completions")
        assert USER_KEY not in unkeyed

    asyncio.run(run())
    assert address_user("127.0.0.2") == "127.0.0.2"
    assert address_user("2001:db8::1") == address_user("2001:db8::ffff:1") == "2001:db8::/64"
    assert address_user("::ffff:10.0.0.1") == "10.0.0.1"


def test_api_keys_come_from_the_flags_else_the_environment() -> None:
    assert api_keys(["a", "b", "a"], {API_KEY_ENV: "c"}) == ("a", "b")
    assert api_keys(None, {API_KEY_ENV: "c, d,"}) == ("c", "d")
    assert api_keys(None, {API_KEY_ENV: ""}) == () == api_keys(None, {})
