"""Server-to-server push: a server sends its output of an inference step straight to the next server of the route.

The client names the next servers of a step (InferenceStep.next_hops); each server runs the step, pushes its output
to the next one (rpc_push), and answers its client as usual, so the client still receives every span's output (to
replay it elsewhere after a failure) while the step itself crosses the network once per server instead of twice.
A server pushes only to servers announced in the swarm's records (it dials their announced addresses), so a client
cannot make it send to arbitrary hosts.

The next server acknowledges each pushed step (accepted, or why not). A server waits for that acknowledgement before
answering its client only while the link is unproven: once the next server has accepted this session's steps within
TRUSTED_LINK_S, the answer goes out as soon as the step is sent and the acknowledgement is read in the background
(before the next step on that link): the wait would add a round trip between the two servers to every step's
critical path, since the client reads each server's answer. A step the next server then refuses fails the client's
read of that server's answer instead, at once (a session whose waiting pushed steps overflow is closed with a busy
error to its client; one that no longer exists has ended its client's stream already), and is repaired as any
failed step.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from swarmlm.net.dialing import Dialer
from swarmlm.net.streams import PeerStream
from swarmlm.protocol.codec import encode, read_message
from swarmlm.protocol.messages import PushHop, PushStep, ReplyHeader
from swarmlm.server.peers import short
from swarmlm.swarm.records import ServerRecord

logger = logging.getLogger(__name__)

# a link whose last step was accepted this recently is trusted to take the next one: far below any idle timeout
# after which the next server would close the push stream (300 s by default), so a trusted link is not a dead one
TRUSTED_LINK_S = 5.0
# why a push failed when the next server ended the stream without acknowledging the step
CLOSED = "the next server closed the push stream without replying"


@dataclass
class _Link:
    """The kept stream to one session on the next server."""

    stream: PeerStream
    replies: AsyncIterator[runtime_pb2.ExpertResponse]
    accepted_at: float = -math.inf  # when the next server last accepted a step (monotonic s)
    ack: asyncio.Task[str | None] | None = None  # reading the acknowledgement of a step answered without it


class Pusher:
    """Sends pushed steps from this server (the `pusher` of server.inference.InferenceSessions), over one stream per
    session it pushes to, kept open between steps: a stream costs round trips to open, a step only its bytes."""

    def __init__(self, p2p: P2P, records: Callable[[], Awaitable[Mapping[str, ServerRecord]]], timeout_s: float):
        self.p2p, self.records, self.timeout_s = p2p, records, timeout_s
        self._dialer = Dialer(timeout_s)
        self._links: dict[str, _Link] = {}  # by session id

    async def __call__(self, hop: PushHop, header: PushStep, tensors: list) -> str | None:
        """None when the step was sent and the next server accepted it (or, on a trusted link, will be asked to
        accept it), else why not (the client then sends it itself)."""
        try:
            peer = PeerID.from_base58(hop.peer_id)
        except (ValueError, TypeError):
            return "the next hop's peer id is not valid"
        for _ in range(2):  # a kept stream the other side closed while idle: once more on a new one
            kept = hop.session_id in self._links
            try:
                async with asyncio.timeout(self.timeout_s):
                    link = await self._link(hop, peer)
                    if link.ack is not None and await link.ack is not None:
                        self.forget(hop.session_id)  # the last step was refused: this stream is no good
                        continue
                    link.ack = None
                    try:
                        await link.stream.send(encode(header, tensors, runtime_pb2.ExpertRequest))
                    except (ConnectionError, OSError):
                        if not kept:
                            raise
                        self.forget(hop.session_id)  # nothing reached the other side: safe to send again
                        continue
                    if time.monotonic() - link.accepted_at < TRUSTED_LINK_S:
                        link.ack = asyncio.create_task(self._acknowledged(link, hop.session_id))
                        return None
                    error = await self._acceptance(link)
            except Exception as e:  # noqa: BLE001 - any failure to push is reported to the client, which takes over
                self.forget(hop.session_id)
                return short(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            if error is None:
                return None
            self.forget(hop.session_id)
            if error != CLOSED or not kept:  # a kept stream ended while idle: once more on a new one
                return error
        return "the next server keeps closing the push stream"

    async def _acceptance(self, link: _Link) -> str | None:
        """None when the next server accepted the step last sent on the link, else why not."""
        message = await read_message(link.replies, ReplyHeader, max_bytes=0)
        if message is None:
            return CLOSED
        reply, _ = message
        if not reply.ok:
            return short(reply.error or "refused")
        link.accepted_at = time.monotonic()
        return None

    async def _acknowledged(self, link: _Link, session_id: str) -> str | None:
        """_acceptance read in the background, by the deadline; failures become the reason (never raised)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                error = await self._acceptance(link)
        except Exception as e:  # noqa: BLE001 - the reason is kept for the next step on this link
            error = short(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        if error is not None:
            logger.info("a step pushed to session ...%s was not accepted: %s", session_id[-6:], error)
        return error

    async def _link(self, hop: PushHop, peer: PeerID) -> _Link:
        link = self._links.get(hop.session_id)
        if link is None:
            if not self._dialer.dialed(hop.peer_id):
                record = (await self.records()).get(hop.peer_id)
                if record is None or not record.addrs:
                    raise ValueError("the next hop is not a server of this swarm")
                await self._dialer.ensure_connected(self.p2p, peer, record.addrs)
            stream = await PeerStream.open(self.p2p, peer, "rpc_push", self.timeout_s, io_timeout_s=self.timeout_s)
            link = self._links[hop.session_id] = _Link(stream, stream.replies())
        return link

    def forget(self, session_id: str) -> None:
        """Close the stream to a session (the session pushing to it ended, or the stream failed)."""
        link = self._links.pop(session_id, None)
        if link is not None:
            if link.ack is not None:
                link.ack.cancel()
            link.stream.close()
