"""Every read and write on an open stream has its own deadline: a peer (real p2pd on 127.0.0.1) that stalls before
its reply or in the middle of one fails the read with TimeoutError, in the stream's own time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from swarmlm.client.loop import LoopThread
from swarmlm.net.dialing import dial
from swarmlm.net.streams import PeerStream
from swarmlm.protocol.codec import encode
from swarmlm.protocol.messages import InfoRequest
from swarmlm.protocol.service import handle_name

IO_TIMEOUT_S = 0.5
STALL_S = 30.0  # far beyond the deadline: only the deadline ends the read
LOOPBACK = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False)

Stall = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(STALL_S)  # reads the request, never replies


async def _half_reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(P2P.MESSAGE_MARKER + (1000).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + bytes(10))
    await writer.drain()
    await asyncio.sleep(STALL_S)  # announced 1000 bytes, sent 10


STALLS: dict[str, tuple[str, Stall]] = {
    "rpc_info": ("to reply", _silent),
    "rpc_push": ("rest of a reply", _half_reply),
}


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[LoopThread, P2P, P2P]]:
    """A stalling server and a client, each its own p2pd, connected on loopback."""
    loop = LoopThread()
    stalling: set[asyncio.Task] = set()  # the handlers still stalling, ended before the peers shut down

    async def start() -> tuple[P2P, P2P]:
        server, client = await P2P.create(**LOOPBACK), await P2P.create(**LOOPBACK)
        for method, (_, stall) in STALLS.items():

            async def handle(
                info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stall: Stall = stall
            ) -> None:
                task = asyncio.current_task()
                assert task is not None
                stalling.add(task)
                try:
                    await stall(reader, writer)
                finally:
                    stalling.discard(task)
                    writer.close()

            await server.add_binary_stream_handler(handle_name(method), handle)
        addrs = [str(addr) for addr in await server.get_visible_maddrs()]
        await dial(client, server.peer_id, addrs, timeout_s=10.0)
        return server, client

    async def end_stalls() -> None:
        for task in stalling:
            task.cancel()
        await asyncio.gather(*stalling, return_exceptions=True)

    server, client = loop.run(start())
    try:
        yield loop, server, client
    finally:
        loop.run(end_stalls())
        loop.run(client.shutdown())
        loop.run(server.shutdown())
        loop.close()


@pytest.mark.parametrize("method", list(STALLS))
def test_a_read_from_a_stalled_peer_times_out_on_its_own(peers: tuple[LoopThread, P2P, P2P], method: str) -> None:
    loop, server, client = peers

    async def call() -> float:
        stream = await PeerStream.open(client, server.peer_id, method, timeout_s=10.0, io_timeout_s=IO_TIMEOUT_S)
        try:
            await stream.send(encode(InfoRequest(), [], runtime_pb2.ExpertRequest))
            began = time.monotonic()
            with pytest.raises(TimeoutError, match=STALLS[method][0]):
                await anext(stream.replies())
            return time.monotonic() - began
        finally:
            stream.close()

    waited = loop.run(call())
    assert IO_TIMEOUT_S * 0.8 <= waited < IO_TIMEOUT_S + 2.0
