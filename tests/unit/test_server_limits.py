"""The server's budgets without sockets: first-come-first-served cache, per-peer ledger, failed inference steps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch
from hivemind.proto import runtime_pb2

from swarmlm.protocol.codec import encode, read_message
from swarmlm.protocol.messages import InferenceOpen, InferenceStep, ReplyHeader
from swarmlm.server.cache import CacheBudget, ServerBusyError
from swarmlm.server.inference import InferenceSessions
from swarmlm.server.peers import LimitError, PeerLedger, PeerLimits, short
from swarmlm.server.validation import SpanLimits


def run(coro):
    return asyncio.run(coro)


def test_a_small_request_does_not_overtake_a_waiting_large_one() -> None:
    async def scenario() -> list[str]:
        budget, order = CacheBudget(10), []
        await budget.reserve(6, timeout_s=1)

        async def reserve(name: str, tokens: int) -> None:
            await budget.reserve(tokens, timeout_s=5)
            order.append(name)

        large = asyncio.create_task(reserve("large", 8))
        await asyncio.sleep(0.01)
        small = asyncio.create_task(reserve("small", 2))  # fits now, but the large one came first
        await asyncio.sleep(0.05)
        assert order == []
        budget.release(6)
        await asyncio.gather(large, small)
        assert budget.used == 10
        return order

    assert run(scenario()) == ["large", "small"]


def test_alloc_timeout_zero_means_do_not_wait() -> None:
    async def scenario() -> None:
        budget = CacheBudget(10)
        await budget.reserve(5, timeout_s=0)  # room: granted at once
        with pytest.raises(ServerBusyError, match="did not wait"):
            await budget.reserve(6, timeout_s=0)
        assert budget.used == 5

    run(scenario())


def test_a_waiter_that_gives_up_lets_the_next_one_in() -> None:
    async def scenario() -> None:
        budget = CacheBudget(10)
        await budget.reserve(6, timeout_s=0)
        with pytest.raises(ServerBusyError, match="waited"):
            await budget.reserve(8, timeout_s=0.05)
        await budget.reserve(4, timeout_s=0.05)  # nobody is in line any more
        assert budget.used == 10
        with pytest.raises(ServerBusyError) as e:
            await budget.reserve(11, timeout_s=1)
        assert e.value.error_kind == "too_large"

    run(scenario())


class SpanOnly:
    """A backend holding blocks 2:7 whose sessions take no steps."""

    def __init__(self) -> None:
        self.limits = SpanLimits(start=2, end=7, hidden_size=8, max_tokens=64, max_position=128)

    def session_ended(self, cache) -> None:
        pass


async def _open_then_wait(header: InferenceOpen, done: asyncio.Event) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    for part in encode(header, [], _REQ):
        yield part
    await done.wait()  # the stream stays open (and the session with it) until the test is done


def test_a_session_reserves_cache_at_the_blocks_it_uses_only() -> None:
    """Petals' server-info case: 100 tokens over blocks 2:5 of a server holding 2:7 take 300 block-tokens, not 500.
    Sessions over 2:5 and 5:7 then fit together in a cache of 100 tokens at each of the 5 blocks, and nothing more."""

    async def scenario() -> None:
        ledger = PeerLedger(PeerLimits(memory_bytes=1 << 20, sessions_per_peer=4, sessions_total=4, cache_share=1.0))
        budget, done = CacheBudget(100 * 5), asyncio.Event()
        sessions = InferenceSessions(SpanOnly(), budget, ledger, alloc_timeout_s=0, idle_timeout_s=5, chunk_tokens=64)
        streams = []

        async def open_session(start: int, end: int, max_length: int) -> ReplyHeader:
            header = InferenceOpen(start_block=start, end_block=end, batch_size=1, max_length=max_length)
            replies = sessions.serve(_open_then_wait(header, done), "peer")
            streams.append(replies)
            opened = await read_message(replies, ReplyHeader, max_bytes=1 << 20)
            assert opened is not None
            return opened[0]

        assert (await open_session(2, 5, 100)).ok and budget.used == 300
        assert (await open_session(5, 7, 100)).ok and budget.used == 500
        refused = await open_session(6, 7, 1)  # one token at one block more than the cache holds
        assert refused.error_kind == "busy" and "500 of 500 cache block-tokens" in refused.error
        done.set()
        for replies in streams:
            async for _ in replies:
                pass
        assert budget.used == 0 and ledger.usage("peer").cache_tokens == 0

    run(scenario())


def test_peer_ledger_caps_sessions_bytes_and_cache_share() -> None:
    async def scenario() -> None:
        ledger = PeerLedger(PeerLimits(memory_bytes=100, sessions_per_peer=2, sessions_total=3, cache_share=0.5))
        ledger.open_session("a")
        ledger.open_session("a")
        with pytest.raises(LimitError, match="already holds 2"):
            ledger.open_session("a")
        ledger.open_session("b")
        with pytest.raises(LimitError, match="3 inference sessions"):
            ledger.open_session("c")
        with pytest.raises(LimitError) as e:
            ledger.check_cache("c", 60, capacity=100)
        assert e.value.error_kind == "too_large"
        await ledger.acquire_bytes("a", 80, timeout_s=0)
        with pytest.raises(LimitError) as e:
            await ledger.acquire_bytes("a", 40, timeout_s=0.05)
        assert e.value.error_kind == "busy"
        await ledger.acquire_bytes("b", 40, timeout_s=0)  # other peers are not affected
        waiting = asyncio.create_task(ledger.acquire_bytes("a", 40, timeout_s=1))
        await asyncio.sleep(0.01)
        ledger.release_bytes("a", 80)
        await waiting
        assert ledger.usage("a").buffered_bytes == 40

    run(scenario())


def test_short_cuts_long_text() -> None:
    assert short("x" * 10) == "x" * 10
    assert len(short("x" * 40_000)) < 600


class FailingBackend:
    """A backend whose steps raise; with `touch_cache`, after writing one block's cache (a half-done step)."""

    def __init__(self, touch_cache: bool):
        self.limits = SpanLimits(start=0, end=2, hidden_size=8, max_tokens=64, max_position=64)
        self.touch_cache = touch_cache

    async def step(
        self,
        cache,
        start,
        end,
        inputs,
        chunk_tokens,
        start_from=None,
        peer="",
        adapter=None,
        lora=None,
        host="",
    ):
        if self.touch_cache:
            cache.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), 0)
        raise RuntimeError("boom " + "x" * 5000)

    def session_ended(self, cache) -> None:
        pass


def session_replies(touch_cache: bool) -> list[ReplyHeader]:
    async def scenario() -> list[ReplyHeader]:
        ledger = PeerLedger(PeerLimits(memory_bytes=1 << 20, sessions_per_peer=1, sessions_total=1, cache_share=1.0))
        budget = CacheBudget(100)
        sessions = InferenceSessions(
            FailingBackend(touch_cache), budget, ledger, alloc_timeout_s=0, idle_timeout_s=5, chunk_tokens=64
        )

        async def parts() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            for part in encode(InferenceOpen(start_block=0, end_block=2, batch_size=1, max_length=8), [], _REQ):
                yield part
            for _ in range(2):
                for part in encode(InferenceStep(), [torch.randn(1, 1, 8)], _REQ):
                    yield part

        replies = sessions.serve(parts(), "peer")
        headers = []
        while (message := await read_message(replies, ReplyHeader, max_bytes=1 << 20)) is not None:
            headers.append(message[0])
        assert budget.used == 0 and ledger.usage("peer").sessions == 0
        return headers

    return run(scenario())


_REQ = runtime_pb2.ExpertRequest


def test_a_failed_step_gets_a_server_error_and_the_session_goes_on() -> None:
    opened, first, second = session_replies(touch_cache=False)
    assert opened.ok
    for reply in (first, second):
        assert reply.error_kind == "server" and "boom" in reply.error and len(reply.error) < 600


def test_a_failed_step_that_changed_the_cache_ends_the_session() -> None:
    opened, failed = session_replies(touch_cache=True)
    assert opened.ok and failed.error_kind == "server"
