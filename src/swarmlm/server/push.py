"""Server-to-server push: a server sends its output of an inference step straight to the next server of the route.

The client names the next servers of a step (InferenceStep.next_hops); each server runs the step, pushes its output
to the next one (rpc_push), and answers its client as usual, so the client still receives every span's output (to
replay it elsewhere after a failure) while the step itself crosses the network once per server instead of twice.
A server pushes only to servers announced in the swarm's records (it dials their announced addresses), so a client
cannot make it send to arbitrary hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from swarmlm.client.sequence_manager import dial
from swarmlm.protocol import service
from swarmlm.protocol.codec import encode, read_only_message
from swarmlm.protocol.messages import PushHop, PushStep, ReplyHeader
from swarmlm.server.peers import short
from swarmlm.swarm.records import ServerRecord


async def _parts(header: PushStep, tensors: Sequence[torch.Tensor]) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    for part in encode(header, tensors, runtime_pb2.ExpertRequest):
        yield part


class Pusher:
    """Sends pushed steps from this server (the `pusher` of server.inference.InferenceSessions)."""

    def __init__(self, p2p: P2P, records: Callable[[], Awaitable[Mapping[str, ServerRecord]]], timeout_s: float):
        self.p2p, self.records, self.timeout_s = p2p, records, timeout_s
        self._dialed: set[str] = set()
        self.sent = 0  # pushes the next server accepted

    async def __call__(self, hop: PushHop, header: PushStep, tensors: list) -> str | None:
        """None when the next server accepted the step, else why not (the client then sends it itself)."""
        try:
            peer = PeerID.from_base58(hop.peer_id)
        except (ValueError, TypeError):
            return "the next hop's peer id is not valid"
        try:
            async with asyncio.timeout(self.timeout_s):
                if hop.peer_id not in self._dialed:
                    record = (await self.records()).get(hop.peer_id)
                    if record is None or not record.addrs:
                        return "the next hop is not a server of this swarm"
                    await dial(self.p2p, peer, list(record.addrs))
                    self._dialed.add(hop.peer_id)
                replies = await service.stub(self.p2p, peer).rpc_push(_parts(header, tensors))
                async with contextlib.aclosing(replies):
                    message = await read_only_message(replies, ReplyHeader, max_bytes=0)
        except Exception as e:  # noqa: BLE001 - any failure to push is reported to the client, which takes over
            return short(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        if message is None:
            return "the next server closed the push stream without replying"
        reply, _ = message
        if not reply.ok:
            return short(reply.error or "refused")
        self.sent += 1
        return None
