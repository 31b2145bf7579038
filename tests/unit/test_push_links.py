"""The pusher's links: an unproven link waits for the next server to accept a step before the step is answered; a
link that accepted a step moments ago answers at once and reads the acceptance in the background; a refusal read
that way retires the link before the next step."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch
from hivemind.proto import runtime_pb2

from swarmlm.protocol.codec import encode
from swarmlm.protocol.messages import PushHop, PushStep, ReplyHeader
from swarmlm.server.push import Pusher, _Link

SESSION = "ab" * 16
PEER = "12D3KooWJuPB1q33jsiZZKWsPXQBSbGR3ETp5X8EhNMLiSTbmqk8"
HOP = PushHop(peer_id=PEER, session_id=SESSION, start_from_position=0)
STEP = PushStep(session_id=SESSION, start_from_position=0)


class FakeStream:
    """A push stream whose acknowledgements the test writes."""

    def __init__(self) -> None:
        self.sent, self.closed, self.acks = 0, False, asyncio.Queue[runtime_pb2.ExpertResponse | None]()

    async def send(self, parts: object) -> None:
        self.sent += 1

    def close(self) -> None:
        self.closed = True

    async def replies(self) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        while (part := await self.acks.get()) is not None:
            yield part

    def ack(self, header: ReplyHeader) -> None:
        (part,) = encode(header, [], runtime_pb2.ExpertResponse)
        self.acks.put_nowait(part)


def pusher_with(*streams: FakeStream) -> Pusher:
    pusher = Pusher(p2p=None, records=None, timeout_s=5.0)  # type: ignore[arg-type]
    fresh = iter(streams)

    async def link(hop: PushHop, peer: object) -> _Link:
        if hop.session_id not in pusher._links:
            stream = next(fresh)
            pusher._links[hop.session_id] = _Link(stream, stream.replies())  # type: ignore[arg-type]
        return pusher._links[hop.session_id]

    pusher._link = link  # type: ignore[method-assign]
    return pusher


def test_only_a_link_that_just_accepted_a_step_answers_before_the_acceptance() -> None:
    async def run() -> None:
        first, second = FakeStream(), FakeStream()
        pusher = pusher_with(first, second)
        push = asyncio.create_task(pusher(HOP, STEP, [torch.zeros(1, 1, 8)]))
        await asyncio.sleep(0.05)
        assert not push.done() and first.sent == 1  # unproven: waits for the next server's word
        first.ack(ReplyHeader(ok=True))
        assert await asyncio.wait_for(push, 1) is None
        # proven: the next step is answered with no acknowledgement yet
        assert await asyncio.wait_for(pusher(HOP, STEP, [torch.zeros(1, 1, 8)]), 1) is None
        assert first.sent == 2
        first.ack(ReplyHeader(ok=False, error="busy", error_kind="busy"))  # ...which turns out a refusal
        await asyncio.sleep(0.05)
        # the next step goes on a new stream (unproven again: it waits), the refused one is closed
        push = asyncio.create_task(pusher(HOP, STEP, [torch.zeros(1, 1, 8)]))
        await asyncio.sleep(0.05)
        assert first.closed and second.sent == 1 and not push.done()
        second.ack(ReplyHeader(ok=False, error="no open session has this id", error_kind="bad_request"))
        assert await asyncio.wait_for(push, 1) == "no open session has this id"

    asyncio.run(run())
