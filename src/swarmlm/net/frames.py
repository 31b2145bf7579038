"""hivemind's stream frames (a marker byte, an 8-byte length, the protobuf's bytes), each message written at once.

hivemind's P2P.send_protobuf writes a frame in three pieces. Through the p2p daemon, each write is a system call of
its own that wakes the daemon, which may forward each piece on its own and wake the reader once per piece. A decode
step crosses several such streams (client to server, server to server, and the answers), so the frames of one
message are joined and written with one call; the bytes on the wire are the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from google.protobuf.message import Message
from hivemind.p2p import P2P
from hivemind.proto.p2pd_pb2 import RPCError


def frame(message: Message) -> bytes:
    """One message as hivemind frames it: an RPCError gets the error marker, anything else the message marker."""
    data = message.SerializeToString()
    marker = P2P.ERROR_MARKER if isinstance(message, RPCError) else P2P.MESSAGE_MARKER
    return marker + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data


async def send_frames(writer: asyncio.StreamWriter, messages: Iterable[Message]) -> None:
    """Write the messages' frames with one call, then wait until the transport's buffer drains."""
    writer.write(b"".join(frame(message) for message in messages))
    await writer.drain()
