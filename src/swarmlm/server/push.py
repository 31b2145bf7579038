"""Server-to-server push: a server sends its output of an inference step straight to the next server of the route.

The client names the next servers of a step (InferenceStep.next_hops); each server runs the step, pushes its output
to the next one (rpc_push), and answers its client as usual, so the client still receives every span's output (to
replay it elsewhere after a failure) while the step itself crosses the network once per server instead of twice.
A server pushes only to servers announced in the swarm's records (it dials their announced addresses), so a client
cannot make it send to arbitrary hosts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from swarmlm.client.sequence_manager import dial
from swarmlm.client.streams import PeerStream
from swarmlm.protocol.codec import encode, read_message
from swarmlm.protocol.messages import PushHop, PushStep, ReplyHeader
from swarmlm.server.peers import short
from swarmlm.swarm.records import ServerRecord


class Pusher:
    """Sends pushed steps from this server (the `pusher` of server.inference.InferenceSessions), over one stream per
    session it pushes to, kept open between steps: a stream costs round trips to open, a step only its bytes."""

    def __init__(self, p2p: P2P, records: Callable[[], Awaitable[Mapping[str, ServerRecord]]], timeout_s: float):
        self.p2p, self.records, self.timeout_s = p2p, records, timeout_s
        self._dialed: set[str] = set()
        self._links: dict[str, tuple[PeerStream, AsyncIterator[runtime_pb2.ExpertResponse]]] = {}  # by session id

    async def __call__(self, hop: PushHop, header: PushStep, tensors: list) -> str | None:
        """None when the next server accepted the step, else why not (the client then sends it itself)."""
        try:
            peer = PeerID.from_base58(hop.peer_id)
        except (ValueError, TypeError):
            return "the next hop's peer id is not valid"
        for _ in range(2):  # a kept stream the other side closed while idle: once more on a new one
            kept = hop.session_id in self._links
            try:
                async with asyncio.timeout(self.timeout_s):
                    stream, replies = await self._link(hop, peer)
                    try:
                        await stream.send(encode(header, tensors, runtime_pb2.ExpertRequest))
                    except (ConnectionError, OSError):
                        if not kept:
                            raise
                        self.forget(hop.session_id)  # nothing reached the other side: safe to send again
                        continue
                    message = await read_message(replies, ReplyHeader, max_bytes=0)
            except Exception as e:  # noqa: BLE001 - any failure to push is reported to the client, which takes over
                self.forget(hop.session_id)
                return short(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            if message is None:  # the stream ended without taking the step (it had been idle too long)
                self.forget(hop.session_id)
                if kept:
                    continue
                return "the next server closed the push stream without replying"
            reply, _ = message
            if not reply.ok:
                self.forget(hop.session_id)
                return short(reply.error or "refused")
            return None
        return "the next server keeps closing the push stream"

    async def _link(self, hop: PushHop, peer: PeerID) -> tuple[PeerStream, AsyncIterator[runtime_pb2.ExpertResponse]]:
        link = self._links.get(hop.session_id)
        if link is None:
            if hop.peer_id not in self._dialed:
                record = (await self.records()).get(hop.peer_id)
                if record is None or not record.addrs:
                    raise ValueError("the next hop is not a server of this swarm")
                await dial(self.p2p, peer, list(record.addrs))
                self._dialed.add(hop.peer_id)
            stream = await PeerStream.open(self.p2p, peer, "rpc_push")
            link = self._links[hop.session_id] = (stream, stream.replies())
        return link

    def forget(self, session_id: str) -> None:
        """Close the stream to a session (the session pushing to it ended, or the stream failed)."""
        link = self._links.pop(session_id, None)
        if link is not None:
            link[0].close()
