"""The lifecycle's protocols against an in-memory swarm view: servers joining at once spread out; draining waits,
then closes what is left."""

from __future__ import annotations

import asyncio

import pytest

from swarmlm.server import lifecycle
from swarmlm.server.placement import Span
from swarmlm.swarm.records import ServerRecord, ServerState


@pytest.fixture(autouse=True)
def quick_claims(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "CLAIM_WAIT_S", (0.01, 0.03))


async def join_all(peers: list[str], num_blocks: int, n: int, view: dict[str, ServerRecord]) -> dict[str, Span]:
    async def read() -> dict[str, ServerRecord]:
        seen = dict(view)
        await asyncio.sleep(0)  # a read takes time: the others read the same before anyone claims (all choose alike)
        return seen

    async def join(peer: str) -> Span:
        async def claim(span: Span, since: float) -> ServerRecord:
            view[peer] = ServerRecord(
                state=ServerState.JOINING, start=span[0], end=span[1], throughput=1.0, dtype="float32", since=since
            )
            return view[peer]

        span, _ = await lifecycle.claim_span(read, claim, num_blocks, n, peer)
        return span

    return dict(zip(peers, await asyncio.gather(*(join(peer) for peer in peers)), strict=True))


@pytest.mark.parametrize("contenders", [2, 3])
def test_servers_joining_at_once_take_different_spans(contenders: int, caplog: pytest.LogCaptureFixture) -> None:
    peers = [f"peer-{i}" for i in range(contenders)]
    with caplog.at_level("INFO", logger=lifecycle.__name__):
        spans = asyncio.run(join_all(peers, 7, 3, {}))
    assert len(set(spans.values())) == contenders, spans
    assert "claimed first by another server" in caplog.text  # they all chose block 0 first
    if contenders == 3:
        covered = {block for start, end in spans.values() for block in range(start, end)}
        assert covered == set(range(7))


class FakeSessions:
    def __init__(self, open_sessions: int):
        self.open_sessions, self.accepting, self.closed = open_sessions, True, False

    def stop_accepting(self) -> None:
        self.accepting = False

    def close_all(self) -> None:
        self.closed, self.open_sessions = True, 0


class FakeHandler:
    in_flight = 0


def test_drain_waits_for_sessions_that_end_in_time_and_closes_the_rest() -> None:
    async def ending_soon() -> FakeSessions:
        sessions = FakeSessions(1)
        asyncio.get_running_loop().call_later(0.2, setattr, sessions, "open_sessions", 0)
        await lifecycle.drain(sessions, FakeHandler(), timeout_s=5.0)  # type: ignore[arg-type]
        return sessions

    sessions = asyncio.run(ending_soon())
    assert not sessions.accepting and not sessions.closed

    async def never_ending() -> tuple[FakeSessions, float]:
        sessions, loop = FakeSessions(2), asyncio.get_running_loop()
        began = loop.time()
        await lifecycle.drain(sessions, FakeHandler(), timeout_s=0.3)  # type: ignore[arg-type]
        return sessions, loop.time() - began

    sessions, took = asyncio.run(never_ending())
    assert sessions.closed and 0.3 <= took < 1.0
