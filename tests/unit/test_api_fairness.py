"""The API's slots shared between users (api/fair.py) and a generation's growing session (api/engine.py), decided
without sockets."""

from __future__ import annotations

import asyncio

import pytest

from swarmlm.api.engine import reservation
from swarmlm.api.fair import FairSlots


def test_a_flooding_user_leaves_room_for_others_who_go_first() -> None:
    """One user asks for 10 of 4 slots at once: it gets them all while alone, but once another user comes it holds
    at most 3, and the newcomer is served before the flooder's waiting requests."""

    async def main() -> list[str]:
        slots, order = FairSlots(4), []
        done = {user: asyncio.Event() for user in ("flood", "honest")}

        async def request(user: str) -> None:
            async with slots.hold(user):
                order.append(user)
                await done[user].wait()

        async def settle() -> None:
            for _ in range(5):
                await asyncio.sleep(0)

        flood = [asyncio.create_task(request("flood")) for _ in range(10)]
        await settle()
        assert slots.held["flood"] == 4  # alone: every slot
        honest = asyncio.create_task(request("honest"))
        await settle()
        assert slots.held["honest"] == 0  # no slot is free: it waits, first in line
        done["flood"].set()  # the flooder's requests end one after another
        await settle()
        assert order[4] == "honest"  # the first free slot went to the newcomer
        assert slots.held["flood"] <= slots.cap == 3
        done["honest"].set()
        await asyncio.gather(*flood, honest)
        return order

    order = asyncio.run(main())
    assert order.count("flood") == 10 and order.count("honest") == 1


def test_a_cancelled_wait_gives_nothing_away() -> None:
    async def main() -> FairSlots:
        slots = FairSlots(1)
        async with slots.hold("a"):
            waiting = asyncio.create_task(slots.hold("b").__aenter__())
            await asyncio.sleep(0)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        async with slots.hold("c"):
            assert dict(slots.held) == {"c": 1}
        return slots

    assert not asyncio.run(main()).held


def test_a_session_holds_a_little_more_than_it_used_growing_twice_as_much_each_time() -> None:
    assert reservation(100, 0, 8, 0) == 108  # a short answer: the whole request at once
    assert reservation(100, 0, 8000, 0, initial=256) == 356
    assert reservation(100, 257, 8000, 356, initial=256) == 612
    assert reservation(100, 513, 8000, 612, initial=256) == 1124
    assert reservation(100, 7000, 8000, 7100, initial=256) == 8100  # never beyond what the request may generate
