"""The RPC schema of a server: the table of its methods (name, kind, request and reply headers) and hivemind's
service class that names their p2p handlers. swarmlm.net serves and calls these methods."""

from __future__ import annotations

import enum
from dataclasses import dataclass

# hivemind recognizes streaming methods by typing.AsyncIterator hints only (not collections.abc's)
from typing import AsyncIterator  # noqa: UP035

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.servicer import StubBase
from hivemind.proto import runtime_pb2

from swarmlm.protocol.messages import (
    BackwardRequest,
    ForwardRequest,
    InferenceOpen,
    InferenceStep,
    InfoRequest,
    PushStep,
    ReplyHeader,
    ServerInfo,
    _Header,
)

# A server that has answered a peer which already ended its side waits at most this long for that peer to close the
# stream first: closing first could lose the answer (net/transport.py); the asker closes once it has read it.
CLOSE_LINGER_S = 5.0


class Kind(enum.Enum):
    UNARY = "unary"  # one request message, then the client ends its side; one reply message
    STREAM = "stream"  # request messages until the client ends its side, each answered by one reply message


@dataclass(frozen=True)
class Method:
    """One RPC method of a server, as both sides of the wire know it."""

    name: str  # the rpc_* name; its p2p handler's name is handle_name(name)
    kind: Kind
    requests: tuple[type[_Header], ...]  # the request headers it takes, in order (a stream's first, then the rest)
    reply: type[_Header]  # the header of each reply message


METHODS: dict[str, Method] = {
    method.name: method
    for method in (
        Method("rpc_forward", Kind.UNARY, (ForwardRequest,), ReplyHeader),
        Method("rpc_backward", Kind.UNARY, (BackwardRequest,), ReplyHeader),
        Method("rpc_inference", Kind.STREAM, (InferenceOpen, InferenceStep), ReplyHeader),
        Method("rpc_push", Kind.STREAM, (PushStep,), ReplyHeader),
        Method("rpc_info", Kind.UNARY, (InfoRequest,), ServerInfo),
    )
}


def handle_name(method: str) -> str:
    """The p2p handler name of an rpc_* method (as hivemind's stubs call it): unknown names raise KeyError."""
    return SpanService._get_handle_name(None, METHODS[method].name)


class SpanService(ServicerBase):
    """rpc_forward and rpc_backward take one message (see protocol.codec) and stream back one reply; rpc_inference
    takes InferenceOpen, then InferenceStep messages, answering each one, until the client ends the stream; rpc_push
    takes one PushStep from another server and acknowledges it; rpc_info takes an InfoRequest and answers with a
    ServerInfo."""

    async def rpc_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError("served by swarmlm.server.handler.SpanHandler")
        yield  # pragma: no cover - makes this an async generator, like the implementation

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError("served by swarmlm.server.handler.SpanHandler")
        yield  # pragma: no cover

    async def rpc_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError("served by swarmlm.server.handler.SpanHandler")
        yield  # pragma: no cover

    async def rpc_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError("served by swarmlm.server.handler.SpanHandler")
        yield  # pragma: no cover

    async def rpc_info(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError("served by swarmlm.server.handler.SpanHandler")
        yield  # pragma: no cover


def stub(p2p: P2P, peer: PeerID) -> StubBase:
    """hivemind's own client stub, as other hivemind programs call a server; swarmlm itself calls through
    swarmlm.net (bounded frames, deadlines), and tests use this to check the wire stays compatible."""
    return SpanService.get_stub(p2p, peer)
