"""The server's side of hivemind's protobuf streams, with a bound on every frame, read and write.

hivemind 1.1.12 serves a streaming rpc_* method through `P2P._add_protobuf_stream_handler`, which
- reads each frame whole with `P2P.receive_raw_data`: an 8-byte length, then `readexactly(length)` of any length
  the peer declares (a 400 MB frame is buffered before anything can refuse it);
- puts parsed frames in a per-stream `asyncio.Queue(max_prefetch=5)` and blocks on `put` while it is full, so it
  stops seeing the peer's end of stream;
- writes replies with `writer.drain()` and no deadline: a peer that stops reading blocks the handler forever, which
  with the full queue above holds a session (and its cache budget) until the server restarts.
This module registers the same handler names (wire compatible with hivemind's client stubs) through
`add_binary_stream_handler` and reads the same frames itself: each frame's declared length is checked and charged to
the peer's byte budget (PeerLedger) before its bytes are read, every body read and reply write has a deadline, and a
peer that vanishes or stops reading loses its stream (the handler is closed, so its session frees its budget).

Who closes a stream first matters. p2pd (go-libp2p 0.32, yamux v4) pipes each stream to a unix socket; when our side
closes it, the daemon's `Stream.Close()` first closes the stream for reading, which wakes its own reader goroutine
with "stream reset" and makes it `Reset()` the stream, racing the FIN. Whenever the reset wins, the peer's yamux drops
whatever of our last reply its daemon had not read yet: on a loaded machine, now and then a reply was lost.
So a reply written after the peer ended its side (a forward, a backward, an info answer) is followed by a linger:
the peer, which closes as soon as it has read its one reply, closes first, and the lost-reply race cannot happen.
A refusal written while the peer is still sending (a frame over the limits, a malformed part) is followed by a
drain: what the peer sends on is read and dropped, within a time and a byte bound, until it closes, so the refusal
reaches it rather than a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, P2PContext
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from swarmlm.errors import LimitError, ProtocolError, short
from swarmlm.net.arrival import TIMEOUT_KIND, arrival_timeout
from swarmlm.net.frames import send_frames
from swarmlm.net.peerlog import PEER_FAULTS
from swarmlm.protocol.codec import MAX_CHUNKS_PER_PART
from swarmlm.protocol.service import CLOSE_LINGER_S, METHODS, handle_name

logger = logging.getLogger(__name__)

# Python keeps a parsed frame in objects a few times its wire size; each frame is charged at least this much
FRAME_OVERHEAD_BYTES = 4096
# frames read ahead of the handler, as in hivemind (its default max_prefetch)
PREFETCH_FRAMES = 5
# ExpertRequest's field number of its repeated tensors (hivemind/proto/runtime.proto)
TENSORS_FIELD = 2
# our parts have 1-3 top-level fields; a frame of thousands of tiny fields is refused without parsing it
MAX_FIELDS_PER_PART = 64
# after a refusal, at most this much of what the peer sends on is read and dropped (at most CLOSE_LINGER_S long)
# before the stream closes: a few maximal requests, while the refusal travels to the peer
MAX_DRAIN_BYTES = 64 << 20
DRAIN_READ_BYTES = 1 << 16  # one read of that drain
BODY_READ_BYTES = 1 << 20  # one read of a frame's body (each read that brings bytes restarts the arrival deadline)

# handlers are async generators: closing one runs its cleanup
Replies = AsyncGenerator[runtime_pb2.ExpertResponse, None]
Handler = Callable[[AsyncIterator[runtime_pb2.ExpertRequest], P2PContext], Replies]


class StreamHold(Protocol):
    """What the budget knows of one open stream, to choose whom to close when one of its pools is full."""

    active_at: float  # loop time of its last frame read or reply written
    busy: bool  # its handler works on what it read (is not waiting for more)
    bytes: int  # request bytes it has buffered


@dataclass
class _Unheld:
    """A stream's hold before the budget counted it."""

    active_at: float = 0.0
    busy: bool = False
    bytes: int = 0


class ByteBudget(Protocol):
    """Bytes each peer may have buffered and streams it may hold open on this server (server.peers.PeerLedger)."""

    async def acquire_bytes(self, peer: str, size: int, timeout_s: float) -> None: ...

    def release_bytes(self, peer: str, size: int) -> None: ...

    def open_stream(self, peer: str, address: str, cut: Callable[[], None]) -> StreamHold:
        """Count a new stream from the peer's remote multiaddr (LimitError if it may not open); `cut` closes it."""
        ...

    def close_stream(self, holding: StreamHold) -> None: ...


@dataclass(frozen=True)
class Gate:
    """Who is served (a private swarm's members): a peer that `admits` refuses is answered by `outsider` instead."""

    admits: Callable[[str], bool]  # by base58 peer id
    outsider: Handler


@dataclass(frozen=True)
class StreamLimits:
    max_frame_bytes: int  # largest frame a peer may send (our parts are <= 1 MiB of tensor data plus a header)
    read_timeout_s: float  # longest a frame's body, once announced, may take to arrive in full
    write_timeout_s: float  # longest a reply may wait for the peer to read it
    arrival_timeout_s: float  # longest a frame's body, once announced, may go without a byte arriving


class _EndOfFrames(Exception):  # a signal between the reader and the handler's iterator, not an error
    """The peer ended its stream (or vanished)."""


class _Stream:
    """One peer stream: a reader task feeding a bounded queue, the handler's request iterator, byte accounting."""

    def __init__(self, peer: str, reader: asyncio.StreamReader, ledger: ByteBudget, limits: StreamLimits):
        self.peer, self.reader, self.ledger, self.limits = peer, reader, ledger, limits
        self.queue: asyncio.Queue = asyncio.Queue(PREFETCH_FRAMES)
        self.holding: StreamHold = _Unheld()  # set once the budget counted the stream
        self.charged = 0  # bytes of this stream charged to the peer (queued, being read or being served)
        self.consumed = 0  # of those, bytes of frames the handler has taken and not answered yet
        self.vanished = False  # the connection broke (not a clean end of stream)
        self.ended = False  # the peer ended its side cleanly: it sends nothing more
        self.reply_after_end = False  # the last reply was written after that end (the peer may still be reading it)
        self.wrote_last = False  # the handler's last reply (or error) reached the stream within its deadline

    async def requests(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        """What the handler iterates: parsed frames, then the end; a limit hit while reading raises LimitError."""
        while True:
            self.holding.busy = False  # waiting for the peer: closing the stream now would waste no work
            item = await self.queue.get()
            self.holding.busy = True
            if item is None:
                return
            if isinstance(item, ProtocolError):
                raise item
            part, size = item
            del item
            self.consumed += size
            yield part
            del part  # not held while the next frame is awaited: the handler copies what it needs out of it

    def answered(self) -> None:
        """The handler's reply was written: the frames it read so far are done with."""
        self._release(self.consumed)
        self.consumed = 0
        self.holding.busy = False
        self.holding.active_at = asyncio.get_running_loop().time()

    def _release(self, size: int) -> None:
        self.charged -= size
        self.holding.bytes = self.charged
        self.ledger.release_bytes(self.peer, size)

    def close(self) -> None:
        self._release(self.charged)
        self.consumed = 0

    async def read_frames(self) -> None:
        """Read frames until the peer ends the stream; on a broken limit, hand the handler the error and stop."""
        try:
            while True:
                item = await self._read_frame()
                self.ended = item is None
                await self.queue.put(item)
                if item is None:
                    break
                del item  # the handler has it: not held while the next frame arrives
        except _EndOfFrames:
            self.vanished = True
            await self.queue.put(None)
            return
        except ProtocolError as e:
            await self.queue.put(e)
            return
        # the request has ended cleanly; hivemind's clients keep the connection open until they have read every
        # reply, so a connection closed now (or anything more sent) means the caller gave up: stop working for it
        with contextlib.suppress(ConnectionError):
            await self.reader.read(1)
        self.vanished = True

    async def _read_frame(self) -> tuple[runtime_pb2.ExpertRequest, int] | None:
        try:
            marker = await self.reader.readexactly(1)  # between frames: no deadline here (sessions idle between steps)
            async with asyncio.timeout(self.limits.arrival_timeout_s):
                length = int.from_bytes(await self.reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise _EndOfFrames from e
        except TimeoutError as e:
            raise arrival_timeout("a frame's header", self.limits.arrival_timeout_s) from e
        if length > self.limits.max_frame_bytes:
            raise LimitError(
                f"a frame of {length} bytes exceeds this server's limit of {self.limits.max_frame_bytes}", "too_large"
            )
        if marker == P2P.ERROR_MARKER:  # hivemind's clients end a stream with an (empty) error frame
            await self._read_body(length)
            return None
        if marker != P2P.MESSAGE_MARKER:
            raise ProtocolError(f"unknown frame marker {marker!r}")
        size = length + FRAME_OVERHEAD_BYTES
        await self.ledger.acquire_bytes(self.peer, size, self.limits.read_timeout_s)
        self.charged += size
        self.holding.bytes = self.charged
        data = await self._read_body(length)
        self.holding.active_at = asyncio.get_running_loop().time()
        if not _few_chunks(data, MAX_CHUNKS_PER_PART):
            raise ProtocolError(f"a part has over {MAX_CHUNKS_PER_PART} chunks or {MAX_FIELDS_PER_PART} fields")
        part = runtime_pb2.ExpertRequest()
        try:
            part.ParseFromString(data)
        except DecodeError as e:
            raise ProtocolError(f"a frame is not a valid protobuf message: {e}") from e
        return part, size

    async def _read_body(self, length: int) -> bytes:
        """A frame's body, arriving without a pause over arrival_timeout_s and in full within read_timeout_s."""
        limits, loop = self.limits, asyncio.get_running_loop()
        chunks, left = [], length
        try:
            async with asyncio.timeout(limits.read_timeout_s) as whole, asyncio.timeout(None) as pause:
                while left:
                    pause.reschedule(loop.time() + limits.arrival_timeout_s)
                    chunk = await self.reader.read(min(left, BODY_READ_BYTES))
                    if not chunk:
                        raise _EndOfFrames
                    chunks.append(chunk)
                    left -= len(chunk)
        except TimeoutError as e:
            if not whole.expired():
                raise arrival_timeout(f"a frame of {length} bytes", limits.arrival_timeout_s) from e
            raise LimitError(
                f"a frame of {length} bytes did not arrive in {limits.read_timeout_s:.0f} s", TIMEOUT_KIND
            ) from e
        except ConnectionError as e:
            raise _EndOfFrames from e
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _few_chunks(data: bytes, limit: int) -> bool:
    """Whether a serialized ExpertRequest holds at most `limit` tensors (field 2), found by walking its top-level
    fields: parsing first would expand a frame of empty tensors to ~40x its size in Python objects."""
    position, count = 0, 0
    for _ in range(MAX_FIELDS_PER_PART):
        if position >= len(data):
            return True
        tag, position = _varint(data, position)
        if tag & 7 == 2:  # length-delimited: tensors, metadata, uid
            size, position = _varint(data, position)
            position += size
            count += tag >> 3 == TENSORS_FIELD
            if count > limit:
                return False
        elif tag & 7 == 0:
            _, position = _varint(data, position)
        else:
            return True  # not our layout: ParseFromString decides
    return position >= len(data)


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while position < len(data) and shift < 64:
        byte = data[position]
        value |= (byte & 0x7F) << shift
        position, shift = position + 1, shift + 7
        if not byte & 0x80:
            break
    return value, position


async def register(
    p2p: P2P, implementation: object, ledger: ByteBudget, limits: StreamLimits, gate: Gate | None = None
) -> None:
    """Serve `implementation`'s rpc_* methods (protocol.service.METHODS) under their handler names, through bounded
    streams; with `gate` (a private swarm), only to the peers it admits."""
    for method in METHODS:
        name = handle_name(method)
        handler = getattr(implementation, method)

        async def handle(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         handler: Handler = handler, name: str = name) -> None:  # fmt: skip
            if gate is not None and not gate.admits(info.peer_id.to_base58()):
                handler = gate.outsider
            try:
                await _serve_stream(handler, name, p2p, info, reader, writer, ledger, limits)
            except Exception as e:  # noqa: BLE001 - p2pd runs this as a task nobody awaits: its failure is told here
                peer = info.peer_id.to_base58()
                PEER_FAULTS.warning(
                    logger, peer, "stream failed peer=...%s: %s", peer[-6:], short(f"{type(e).__name__}: {e}")
                )

        await p2p.add_binary_stream_handler(name, handle)


async def unregister(p2p: P2P, timeout_s: float) -> None:
    """Stop serving the rpc_* methods (streams already open go on until they end)."""
    async with asyncio.timeout(timeout_s):
        await asyncio.gather(*(p2p.remove_binary_stream_handler(handle_name(method)) for method in METHODS))


async def _serve_stream(
    handler: Handler, name: str, p2p: P2P, info: StreamInfo, reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter, ledger: ByteBudget, limits: StreamLimits,
) -> None:  # fmt: skip
    context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=info.peer_id)
    tasks: list[asyncio.Task] = []

    def cut() -> None:  # the budget closes this stream for a peer that waits
        for task in tasks:
            task.cancel()

    try:
        holding = ledger.open_stream(info.peer_id.to_base58(), str(info.addr), cut)
    except LimitError as e:
        await _refuse_stream(writer, info.peer_id.to_base58(), e, limits)
        return
    stream = _Stream(info.peer_id.to_base58(), reader, ledger, limits)
    reading = asyncio.create_task(stream.read_frames())
    processing = asyncio.create_task(_answer(handler(stream.requests(), context), stream, writer, limits))
    stream.holding = holding
    tasks += [reading, processing]
    try:
        # a clean end of stream lets the handler finish its answers; a broken connection ends it at once
        while not processing.done():
            await asyncio.wait({processing, reading}, return_when=asyncio.FIRST_COMPLETED)
            if reading.done() and stream.vanished:
                break
        if stream.wrote_last and not stream.ended and not stream.vanished:
            # answered (refused) while the peer still sends: it stops when it reads that, so let it close first
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            await _drain(reader)
        elif stream.reply_after_end and not reading.done():
            # the peer reads its reply and closes: let it close first (see the module's docstring)
            await asyncio.wait({reading}, timeout=CLOSE_LINGER_S)
    finally:
        for task in (reading, processing):
            task.cancel()
        await asyncio.gather(reading, processing, return_exceptions=True)
        stream.close()
        ledger.close_stream(holding)
        writer.close()


async def _refuse_stream(writer: asyncio.StreamWriter, peer: str, error: LimitError, limits: StreamLimits) -> None:
    """Answer a stream over the stream limits with an error frame, and close it."""
    PEER_FAULTS.warning(logger, peer, "stream refused peer=...%s: %s", peer[-6:], error)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(send_frames(writer, [RPCError(message=short(str(error)))]), limits.write_timeout_s)
    writer.close()


async def _answer(
    replies: Replies, stream: _Stream, writer: asyncio.StreamWriter,
    limits: StreamLimits,
) -> None:  # fmt: skip
    """Send the handler's replies, each within the write deadline; a peer that does not read loses the stream."""
    try:
        await _send_all(replies, stream, writer, limits)
    except Exception as e:  # noqa: BLE001 - a handler's failure reaches the peer as a short error, as in hivemind
        PEER_FAULTS.warning(
            logger, stream.peer, "handler failed peer=...%s: %s", stream.peer[-6:], short(f"{type(e).__name__}: {e}")
        )
        stream.wrote_last = False
        with contextlib.suppress(Exception):
            error = RPCError(message=short(f"{type(e).__name__}: {e}"))
            await asyncio.wait_for(send_frames(writer, [error]), limits.write_timeout_s)
            stream.wrote_last = True


async def _drain(reader: asyncio.StreamReader) -> None:
    """Read and drop what the peer sends until it closes, for at most CLOSE_LINGER_S and MAX_DRAIN_BYTES."""
    loop = asyncio.get_running_loop()
    deadline, dropped = loop.time() + CLOSE_LINGER_S, 0
    with contextlib.suppress(TimeoutError, ConnectionError):
        while dropped < MAX_DRAIN_BYTES:
            data = await asyncio.wait_for(reader.read(DRAIN_READ_BYTES), max(0.0, deadline - loop.time()))
            if not data:
                return
            dropped += len(data)


async def _send_all(
    replies: Replies, stream: _Stream, writer: asyncio.StreamWriter,
    limits: StreamLimits,
) -> None:  # fmt: skip
    async with contextlib.aclosing(replies):  # closing runs the handler's cleanup (session and budget release)
        async for reply in replies:
            stream.reply_after_end = stream.ended
            stream.wrote_last = False
            try:
                await asyncio.wait_for(send_frames(writer, [reply]), limits.write_timeout_s)
            except TimeoutError:
                PEER_FAULTS.warning(logger, stream.peer, "peer ...%s did not read a reply in %.0f s: closing its "
                                    "stream", stream.peer[-6:], limits.write_timeout_s)  # fmt: skip
                return
            except (ConnectionError, RuntimeError):
                logger.debug("peer ...%s closed its stream", stream.peer[-6:])
                return
            # the request's bytes stay charged until its reply is written: a reply is about as large as its request
            # (a forward's output is its input's shape), and a peer that reads slowly holds both
            stream.answered()
            stream.wrote_last = True
