"""One remote call of a span: encode, send, await the reply, and turn every failure into a typed error."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Literal, NamedTuple, TypeVar

import torch
from hivemind.p2p import P2PDaemonError, P2PHandlerError
from hivemind.proto import runtime_pb2

from swarmlm.client import trace
from swarmlm.client.liveness import watched
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.wire import from_wire, marked, on_wire, to_wire
from swarmlm.errors import BadRequestError, ProtocolError, RemoteCallError
from swarmlm.net.info import request_info
from swarmlm.net.streams import PeerStream
from swarmlm.protocol.bundle import ReplyName, ReplyTensors
from swarmlm.protocol.codec import encode, read_message
from swarmlm.protocol.messages import InferenceOpen, ReplyHeader, ServerInfo, _Header

H = TypeVar("H", ReplyHeader, ServerInfo)

# a reply may carry this many bytes beyond its expected tensors (bf16 travels widened to float32; chunk framing)
REPLY_SLACK_BYTES = 64 << 10
# stream close waits at most this long for the server to finish (the session is over for us anyway)
CLOSE_TIMEOUT_S = 5.0
# transport failures: the server or the connection is gone
_TRANSPORT_ERRORS = (P2PDaemonError, P2PHandlerError, ConnectionError, OSError, asyncio.IncompleteReadError)


def call_work(blocks: int, tensors: Sequence[torch.Tensor]) -> int:
    """Blocks x tokens a call asks for: the size against which its measured time is costed."""
    tokens = tensors[0].shape[0] * tensors[0].shape[1] if tensors and tensors[0].dim() >= 2 else 0
    return blocks * tokens


# what a server's refusal says another server may do: RerouteError's kinds
RerouteKind = Literal["busy", "too_large", "timeout", "not_served"]


class RerouteError(RemoteCallError):
    """The server cannot take this request now ("busy", or "timeout": the request stopped arriving there), at this
    size ("too_large"), or at all ("not_served": it does not hold the blocks or adapter named); another server may."""

    def __init__(self, message: str, peer_id: str | None, kind: RerouteKind, retry_after_s: float | None = None):
        super().__init__(message, peer_id)
        self.kind = kind
        self.retry_after_s = retry_after_s  # a busy server's estimate of when it has room (a claim: bounded by users)


class Expected(NamedTuple):
    """One tensor a reply must carry: the client knows every reply's shapes and dtypes before it asks."""

    shape: torch.Size
    dtype: torch.dtype

    @classmethod
    def like(cls, tensor: torch.Tensor) -> Expected:
        return cls(tensor.shape, tensor.dtype)


# the tensors a reply must carry, by name: exactly those its request asks for (protocol.bundle.ReplyTensors)
Expects = Mapping[ReplyName, Expected]


def reply_bytes(expected: Sequence[Expected]) -> int:
    """The most tensor bytes a correct reply carries: what the client reads before it calls the reply malformed."""
    return sum(e.shape.numel() * max(e.dtype.itemsize, 4) for e in expected) + REPLY_SLACK_BYTES


def check_reply_tensors(
    reply: ReplyHeader, outputs: list[torch.Tensor], expected: Expects, method: str, peer_id: str
) -> ReplyTensors:
    """The reply's bundle, which must name exactly the expected tensors and carry them in the expected shapes and
    dtypes; anything else is this server's failure."""
    try:
        bundle = ReplyTensors.from_wire(reply.tensors, outputs, expected=list(expected))
    except ProtocolError as e:
        raise RemoteCallError(f"{method} got a malformed reply: {e}", peer_id) from e
    check_outputs(bundle.tensors(), [expected[name] for name in bundle.names()], method, peer_id)
    return bundle


def widened(bundle: ReplyTensors, expected: Expects) -> ReplyTensors:
    """A reply's tensors widened back to the dtypes the caller expects (client/wire.py)."""
    names = bundle.names()
    tensors = from_wire(bundle.tensors(), [expected[name].dtype for name in names])
    return replace(bundle, **dict(zip(names, tensors, strict=True)))


def check_outputs(outputs: list[torch.Tensor], expected: Sequence[Expected], method: str, peer_id: str) -> None:
    """Replies of the wrong shape or dtype, or with NaN/inf, are this server's failure: they never reach the user."""
    got = [Expected.like(o) for o in outputs]
    if got != list(expected):
        shown = [(tuple(e.shape), str(e.dtype)) for e in got]
        want = [(tuple(e.shape), str(e.dtype)) for e in expected]
        raise RemoteCallError(f"{method} reply has tensors {shown}, expected {want}", peer_id)
    if not all(torch.isfinite(o).all() for o in outputs if o.is_floating_point()):
        raise RemoteCallError(f"{method} reply has non-finite values", peer_id)


@contextlib.contextmanager
def remote_errors(method: str, peer_id: str, timeout_s: float) -> Iterator[None]:
    """Translate what can go wrong while talking to a server into RemoteCallError."""
    try:
        yield
    except TimeoutError as e:
        raise RemoteCallError(f"{method} timed out after {timeout_s:.0f} s", peer_id) from e
    except _TRANSPORT_ERRORS as e:
        raise RemoteCallError(f"{method} failed: {type(e).__name__}: {e}", peer_id) from e
    except ProtocolError as e:
        raise RemoteCallError(f"{method} got a malformed reply: {e}", peer_id) from e


def check_reply(
    message: tuple[ReplyHeader, list[torch.Tensor]] | None, method: str, peer_id: str
) -> tuple[ReplyHeader, list[torch.Tensor]]:
    """The reply's tensors, or BadRequestError (the request is invalid anywhere) / RemoteCallError (this server)."""
    if message is None:
        raise RemoteCallError(f"{method}: the server closed the stream without replying", peer_id)
    reply, outputs = message
    if not reply.ok:
        text = f"server refused {method}: {reply.error}"
        if reply.error_kind == "bad_request":
            raise BadRequestError(text, peer_id)
        if reply.error_kind in ("busy", "too_large", "timeout", "not_served"):
            raise RerouteError(text, peer_id, reply.error_kind, reply.retry_after_s)
        raise RemoteCallError(text, peer_id)
    return reply, outputs


async def call_span(
    manager: SequenceManager,
    peer_id: str,
    method: str,
    header: _Header,
    tensors: Sequence[torch.Tensor],
    expected: Expects,
) -> tuple[ReplyHeader, ReplyTensors]:
    """Send one request to `method` on `peer_id` and return the reply, which must carry exactly the `expected`
    tensors.

    Raises BadRequestError when the server rejected the request as invalid, RerouteError when it is busy or the
    request too large for it, and RemoteCallError for any other failure of the server, its reply or the connection.
    Connecting, sending, reading (at most the expected bytes) and closing the stream share one deadline.
    """
    began = time.perf_counter()
    timeout_s = manager.config.request_timeout_s
    sent, wire_expected = to_wire(tensors, manager.wire), expected_on_wire(expected, manager.wire)
    with remote_errors(method, peer_id, timeout_s):
        async with asyncio.timeout(timeout_s):
            limit = reply_bytes(list(wire_expected.values()))
            exchange = _one_exchange(manager, peer_id, method, marked(header, manager.wire), sent, ReplyHeader, limit)
            message = await watched(exchange, manager, [peer_id])
    reply, outputs = _checked(manager, message, method, peer_id, time.perf_counter() - began)
    bundle = check_reply_tensors(reply, outputs, wire_expected, method, peer_id)
    # the whole time by our clock, compute included: the compute time a server reports is its claim, not a measure
    start, end = getattr(header, "start_block", 0), getattr(header, "end_block", 0)
    elapsed_s = time.perf_counter() - began
    manager.record_success(peer_id, elapsed_s, call_work(end - start, tensors))
    trace.record_call(peer_id, start, end, getattr(header, "kind", method), elapsed_s * 1e3, reply.compute_ms)
    return reply, widened(bundle, expected)


def expected_on_wire(expected: Expects, wire: torch.dtype) -> dict[ReplyName, Expected]:
    """What a reply carries on the wire when the request's float32 tensors travelled as `wire` (client/wire.py)."""
    dtypes = on_wire([e.dtype for e in expected.values()], wire, [len(e.shape) for e in expected.values()])
    return {name: Expected(e.shape, dtype) for (name, e), dtype in zip(expected.items(), dtypes, strict=True)}


async def fetch_info(manager: SequenceManager, peer_id: str) -> ServerInfo:
    """Ask a server to describe itself now (span, version, fingerprint, limits, free cache, speed)."""
    timeout_s = manager.config.request_timeout_s
    with remote_errors("rpc_info", peer_id, timeout_s):
        async with asyncio.timeout(timeout_s):
            info = await request_info(manager.p2p, await manager.ensure_connected(peer_id), timeout_s)
    if info is None:
        raise RemoteCallError("rpc_info: the server closed the stream without replying", peer_id)
    return info


async def _one_exchange(
    manager: SequenceManager, peer_id: str, method: str, header: _Header, tensors: Sequence[torch.Tensor],
    reply_type: type[H], max_bytes: int,
) -> tuple[H, list[torch.Tensor]] | None:  # fmt: skip
    """Send one message on a new stream, end it, read the one reply and close the stream: the server waits for us
    to close first (net/transport.py says why), so nothing after the reply is awaited."""
    peer = await manager.ensure_connected(peer_id)
    timeout_s = manager.config.request_timeout_s
    stream = await PeerStream.open(manager.p2p, peer, method, timeout_s, io_timeout_s=timeout_s)
    try:
        await stream.send(encode(header, tensors, runtime_pb2.ExpertRequest))
        await stream.end()
        return await read_message(stream.replies(), reply_type, max_bytes=max_bytes)
    finally:
        stream.close()  # also when cancelled or failed: the server stops working for us


def _checked(
    manager: SequenceManager,
    message: tuple[ReplyHeader, list[torch.Tensor]] | None,
    method: str,
    peer_id: str,
    round_trip_s: float,
) -> tuple[ReplyHeader, list[torch.Tensor]]:
    try:
        return check_reply(message, method, peer_id)
    except RerouteError:
        # a busy server still answered: its distance is known, so it competes fairly for routes once it has room
        manager.health.observe(peer_id, round_trip_s, 0)
        raise


class SpanStream:
    """A long-lived stream to one server (an inference session): send a message, read its one reply, repeat."""

    def __init__(self, manager: SequenceManager, peer_id: str, method: str):
        self.manager, self.peer_id, self.method = manager, peer_id, method
        self._span = (0, 0)  # blocks of the session, known from its opening message
        self._stream: PeerStream | None = None
        self._replies: AsyncIterator[runtime_pb2.ExpertResponse] | None = None
        self.last_reply: ReplyHeader | None = None  # the header of the last reply read
        # a message was sent (or a pushed reply awaited) and its reply never read, as when the caller was interrupted:
        # that reply may still arrive, so the stream cannot carry another step (its next read would take it)
        self.out_of_step = False

    async def exchange(
        self, header: _Header, tensors: Sequence[torch.Tensor], expected: Expects | None = None,
        watch: Sequence[str] = (),
    ) -> ReplyTensors:  # fmt: skip
        """Send one message and return its reply's tensors: by default those of a session's replies (the output
        hidden states, shaped like the input hidden states; none for a message without tensors). watch: other
        servers the reply waits for (those a pushed step goes on to), whose silence fails the wait too."""
        if expected is None:
            expected = {"hidden": Expected.like(tensors[0])} if tensors else {}
        if isinstance(header, InferenceOpen):  # the opening message: the session's blocks, to cost its steps
            self._span = (header.start_block, header.end_block)
        began = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.manager.config.request_timeout_s
        wire = self.manager.wire
        sent, wire_expected = to_wire(tensors, wire), expected_on_wire(expected, wire)
        with remote_errors(self.method, self.peer_id, self.manager.config.request_timeout_s):
            async with asyncio.timeout_at(deadline):
                if self._stream is None:
                    peer = await self.manager.ensure_connected(self.peer_id)
                    self._stream = await PeerStream.open(
                        self.manager.p2p, peer, self.method, deadline - asyncio.get_running_loop().time(),
                        io_timeout_s=self.manager.config.request_timeout_s,
                    )  # fmt: skip
                    self._replies = self._stream.replies()
                self.out_of_step = True
                await self._stream.send(encode(marked(header, wire), sent, runtime_pb2.ExpertRequest))
        message = await self._read(wire_expected, deadline, watch)
        self.out_of_step = False
        reply, outputs = _checked(self.manager, message, self.method, self.peer_id, time.perf_counter() - began)
        elapsed_s = time.perf_counter() - began
        accepted = self._accept(reply, outputs, expected, getattr(header, "kind", self.method), elapsed_s)
        self.manager.record_success(self.peer_id, elapsed_s, call_work(self._span[1] - self._span[0], tensors))
        return accepted

    async def receive(self, expected: Expects, upstream: str | None = None) -> ReplyTensors:
        """Read one more reply without sending (the answer to a step another server pushed to this session);
        upstream: the server that pushes it, whose silence fails the wait too."""
        began = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.manager.config.request_timeout_s
        upstreams = () if upstream is None else (upstream,)
        self.out_of_step = True
        message = await self._read(expected_on_wire(expected, self.manager.wire), deadline, upstreams)
        self.out_of_step = False
        reply, outputs = check_reply(message, self.method, self.peer_id)
        return self._accept(reply, outputs, expected, "pushed step", time.perf_counter() - began)

    async def _read(
        self, wire_expected: Expects, deadline: float, upstreams: Sequence[str] = ()
    ) -> tuple[ReplyHeader, list[torch.Tensor]] | None:
        """The next reply on the open stream, read by the deadline and only up to the expected bytes; a silent
        server (this one, or another the reply depends on: upstreams) fails the read early (client/liveness.py)."""
        with remote_errors(self.method, self.peer_id, self.manager.config.request_timeout_s):
            async with asyncio.timeout_at(deadline):
                if self._replies is None:
                    raise ProtocolError("the stream is not open")
                limit = reply_bytes(list(wire_expected.values()))
                reading = read_message(self._replies, ReplyHeader, max_bytes=limit)
                return await watched(reading, self.manager, [self.peer_id, *upstreams])

    def _accept(
        self, reply: ReplyHeader, outputs: list[torch.Tensor], expected: Expects, kind: str, elapsed_s: float
    ) -> ReplyTensors:
        """A reply's tensors once checked (as they travelled) and traced, widened back to the expected dtypes."""
        self.last_reply = reply
        wire_expected = expected_on_wire(expected, self.manager.wire)
        bundle = check_reply_tensors(reply, outputs, wire_expected, self.method, self.peer_id)
        trace.record_call(self.peer_id, *self._span, kind, elapsed_s * 1e3, reply.compute_ms)
        return widened(bundle, expected)

    async def close(self) -> None:
        """End the stream (the server frees the session) and wait briefly for the server to finish it."""
        stream, replies, self._stream, self._replies = self._stream, self._replies, None, None
        if stream is None:
            return
        try:
            # best effort: the session is over for us whatever the server says now
            with contextlib.suppress(Exception):
                async with asyncio.timeout(min(CLOSE_TIMEOUT_S, self.manager.config.request_timeout_s)):
                    await stream.end()
                    if replies is not None:
                        async for _ in replies:
                            pass
        finally:
            stream.close()
