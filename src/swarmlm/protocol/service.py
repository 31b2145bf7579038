"""The RPC schema of a server: method names and their streamed message types. Clients take stubs from here;
servers register their implementation under these names."""

from __future__ import annotations

# hivemind recognizes streaming methods by typing.AsyncIterator hints only (not collections.abc's)
from typing import AsyncIterator  # noqa: UP035

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.servicer import StubBase
from hivemind.proto import runtime_pb2

# A server that has answered a peer which already ended its side waits at most this long for that peer to close the
# stream first: closing first could lose the answer (server/transport.py); the asker closes once it has read it.
CLOSE_LINGER_S = 5.0


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


async def register(p2p: P2P, implementation: object) -> None:
    """Serve the methods of `implementation` under SpanService's names."""
    await SpanService().add_p2p_handlers(p2p, wrapper=implementation)


async def unregister(p2p: P2P) -> None:
    await SpanService().remove_p2p_handlers(p2p)


def stub(p2p: P2P, peer: PeerID) -> StubBase:
    return SpanService.get_stub(p2p, peer)
