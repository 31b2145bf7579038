"""The one rpc_info call: ask a server to describe itself, on a bounded stream, within a deadline."""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from swarmlm.net.streams import PeerStream
from swarmlm.protocol.codec import encode, read_message
from swarmlm.protocol.messages import InfoRequest, ServerInfo


async def request_info(p2p: P2P, peer: PeerID, timeout_s: float) -> ServerInfo | None:
    """What `peer` says about itself now; None when it closed the stream without replying. TimeoutError after
    timeout_s; transport and protocol errors as PeerStream raises them.

    The request is sent and the stream ended, the one reply read, and the stream closed: the server waits for the
    asker to close first (net/transport.py says why), so nothing after the reply is awaited."""
    async with asyncio.timeout(timeout_s):
        stream = await PeerStream.open(p2p, peer, "rpc_info", timeout_s, io_timeout_s=timeout_s)
        try:
            await stream.send(encode(InfoRequest(), [], runtime_pb2.ExpertRequest))
            await stream.end()
            message = await read_message(stream.replies(), ServerInfo, max_bytes=0)
        finally:
            stream.close()  # also when cancelled or failed: the server stops working for us
    return None if message is None else message[0]
