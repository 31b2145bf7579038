"""A private swarm's server side: peers prove once that they hold the swarm key; everyone else is refused.

A member opens a JOIN_HANDLER stream and sends its membership token (swarm/private.py: bound to its own peer id,
which libp2p's secure channel authenticates); the server answers one byte and remembers the peer. Every rpc_* stream
of a peer it does not remember gets one short refusal; its request is never decoded (a bounded amount of it is
discarded after the refusal, so that the peer reads the refusal instead of a broken pipe).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator

from hivemind.p2p import P2P, P2PContext
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2

from swarmlm.errors import ProtocolError
from swarmlm.net.peerlog import PEER_FAULTS
from swarmlm.protocol.codec import drain, encode
from swarmlm.protocol.messages import ReplyHeader
from swarmlm.protocol.service import CLOSE_LINGER_S
from swarmlm.swarm.private import (
    JOIN_HANDLER,
    JOIN_OK,
    JOIN_REFUSED,
    OUTSIDER_REFUSAL,
    TOKEN_BYTES,
    is_member_token,
)

logger = logging.getLogger(__name__)

# members remembered (least recently seen forgotten first; a forgotten member joins again on its next connection)
MAX_MEMBERS = 65536
# a joining peer sends its token within this time (and a refused outsider's leftovers are read at most this long)
JOIN_TIMEOUT_S = 10.0
# bytes of a refused outsider's request discarded after the refusal (codec.drain reads a few times this at most)
OUTSIDER_DRAIN_BYTES = 1 << 20


class Members:
    """The peers that proved they hold the swarm key."""

    def __init__(self, key: bytes, capacity: int = MAX_MEMBERS):
        self._key, self._capacity = key, capacity
        self._members: OrderedDict[str, None] = OrderedDict()

    def admits(self, peer_id: str) -> bool:
        if peer_id in self._members:
            self._members.move_to_end(peer_id)
            return True
        return False

    def join(self, peer_id: str, token: bytes) -> bool:
        """Remember `peer_id` if its token proves it holds the key."""
        if not is_member_token(self._key, peer_id, token):
            return False
        self._members[peer_id] = None
        self._members.move_to_end(peer_id)
        while len(self._members) > self._capacity:
            self._members.popitem(last=False)
        return True

    async def register(self, p2p: P2P) -> None:
        await p2p.add_binary_stream_handler(JOIN_HANDLER, self._handle_join)

    async def _handle_join(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), JOIN_TIMEOUT_S)
            admitted = self.join(peer, token)
            if not admitted:
                PEER_FAULTS.warning(logger, peer, "join refused peer=...%s: wrong swarm key", peer[-6:])
            writer.write(JOIN_OK if admitted else JOIN_REFUSED)
            await asyncio.wait_for(writer.drain(), JOIN_TIMEOUT_S)
            # the joiner closes once it has read the answer; closing first could lose it (net/transport.py)
            with contextlib.suppress(TimeoutError, ConnectionError):
                await asyncio.wait_for(reader.read(1), CLOSE_LINGER_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            logger.info("join failed peer=...%s: %s", peer[-6:], type(e).__name__)
        finally:
            writer.close()


async def refuse_outsider(
    requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
) -> AsyncGenerator[runtime_pb2.ExpertResponse, None]:
    """The whole answer to a peer outside the swarm (an rpc_* handler that reads nothing)."""
    reply = ReplyHeader(ok=False, error=OUTSIDER_REFUSAL, error_kind="bad_request")
    for part in encode(reply, [], runtime_pb2.ExpertResponse):
        yield part
    # then discard (a bounded amount of) what it still sends, so its writes do not break its pipe before it reads
    with contextlib.suppress(TimeoutError, ProtocolError):
        await asyncio.wait_for(drain(requests, OUTSIDER_DRAIN_BYTES), JOIN_TIMEOUT_S)
