"""The calling side of a server stream (clients, and servers pushing to the next server): hivemind's frames over a
raw p2pd stream, read and written by us.

hivemind 1.1.12's stream stubs (`P2P._iterate_protobuf_stream_handler`) write requests from a separate task and,
when the connection closes, wait for that task before ending the reply iterator. A session's request iterator
only ends when the session does, so a server that dies while a step is in flight left the client waiting for its
whole request timeout. Here the reply iterator ends (with ConnectionError) as soon as the connection does, and
every reply frame's declared length is checked before its bytes are read, like the server does with requests.

Each read and write on an open stream has its own deadline (io_timeout_s): a peer that stalls mid-reply, or stops
reading our requests, fails the call with TimeoutError, which callers treat as that peer's failure, as they do their
own request deadlines; callers with a request deadline of their own pass it, so no read is cut shorter than it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import TypeVar

from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from swarmlm.errors import ProtocolError
from swarmlm.net.frames import send_frames
from swarmlm.protocol.service import handle_name

# largest reply frame read: our parts carry at most 1 MiB of tensors and a small header (servers allow 4 MB too)
MAX_REPLY_FRAME_BYTES = 4 << 20
# longest one read or write on an open stream waits for the peer by default: a client's request deadline (60 s), which
# a reply may take to come while the server computes
DEFAULT_IO_TIMEOUT_S = 60.0
T = TypeVar("T")


class PeerStream:
    """One open stream to a server's rpc_* method: send request parts, end the stream, read reply parts."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str,
        io_timeout_s: float = DEFAULT_IO_TIMEOUT_S,
    ):  # fmt: skip
        self.reader, self.writer, self.method = reader, writer, method
        self.io_timeout_s = io_timeout_s  # longest one read or write waits for the peer

    @classmethod
    async def open(
        cls, p2p: P2P, peer: PeerID, method: str, timeout_s: float, io_timeout_s: float = DEFAULT_IO_TIMEOUT_S
    ) -> PeerStream:
        """A new stream to `peer`'s `method` (a name of protocol.service.METHODS), opened within timeout_s; each
        read and write on it then waits at most io_timeout_s."""
        async with asyncio.timeout(timeout_s):
            _, reader, writer = await p2p.call_binary_stream_handler(peer, handle_name(method))
        return cls(reader, writer, method, io_timeout_s)

    async def send(self, parts: Iterable[runtime_pb2.ExpertRequest]) -> None:
        await self._within(send_frames(self.writer, parts), "to take our request")

    async def end(self) -> None:
        """Tell the server no more requests follow (hivemind's end of stream: an empty error frame)."""
        await self._within(send_frames(self.writer, [P2P.END_OF_STREAM]), "to take our end of stream")

    async def _within(self, step: Awaitable[T], waiting_for: str) -> T:
        """`step` (one read or write), or TimeoutError naming what the peer failed to do within io_timeout_s."""
        try:
            async with asyncio.timeout(self.io_timeout_s):
                return await step
        except TimeoutError as e:
            raise TimeoutError(f"{self.method}: waited {self.io_timeout_s:g} s for the peer {waiting_for}") from e

    async def replies(self) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Reply parts until the server ends the stream; ConnectionError as soon as the connection is lost mid-frame,
        P2PHandlerError when the server's handler failed, ProtocolError on a malformed or oversized frame."""
        while True:
            try:
                marker = await self._within(self.reader.readexactly(1), "to reply")
            except asyncio.IncompleteReadError:
                return  # the server closed the stream (the caller decides whether a reply was missing)
            data = await self._frame()
            if marker == P2P.ERROR_MARKER:
                error = RPCError()
                error.ParseFromString(data)
                raise P2PHandlerError(f"{self.method} failed on the server: {error.message}")
            if marker != P2P.MESSAGE_MARKER:
                raise ProtocolError(f"unknown frame marker {marker!r}")
            part = runtime_pb2.ExpertResponse()
            try:
                part.ParseFromString(data)
            except DecodeError as e:
                raise ProtocolError(f"a reply frame is not a valid protobuf message: {e}") from e
            yield part

    async def _frame(self) -> bytes:
        try:
            header = await self._within(self.reader.readexactly(P2P.HEADER_LEN), "to send the rest of a reply")
            length = int.from_bytes(header, P2P.BYTEORDER)
            if length > MAX_REPLY_FRAME_BYTES:
                raise ProtocolError(f"a reply frame of {length} bytes exceeds {MAX_REPLY_FRAME_BYTES}")
            return await self._within(self.reader.readexactly(length), "to send the rest of a reply")
        except asyncio.IncompleteReadError as e:
            raise ConnectionError("the connection to the server was lost mid-reply") from e

    def close(self) -> None:
        """Close our end (a server still computing for us sees it and stops)."""
        self.writer.close()
