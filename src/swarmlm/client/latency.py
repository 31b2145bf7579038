"""The client's own round-trip measurement of servers it has not called yet: one timed rpc_info each.

Routing costs a hop by the round trip this client measured to the server (client/health.py). Before its first call
to a server the client knows nothing, so a far replica would be as likely as a near one; a cheap rpc_info call timed
by the client's clock tells them apart before the first route is chosen. A server that cannot be
connected to or does not answer in time is banned as unreachable (announcements are anyone's claims: a fake one must
cost one short wait, not a request's retries), and counts as that far away once the ban is over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from hivemind.p2p import P2P, PeerID

from swarmlm.net.info import request_info

logger = logging.getLogger(__name__)


async def time_info_call(p2p: P2P, peer: PeerID, timeout_s: float) -> float:
    """Seconds one rpc_info round trip to `peer` takes (the connection is expected to be open already);
    timeout_s if it takes longer or fails."""
    began = time.perf_counter()
    try:
        if await request_info(p2p, peer, timeout_s) is None:
            return timeout_s
    except Exception as e:  # noqa: BLE001 - whatever fails, the server is as far as the deadline for routing
        logger.debug("Timing rpc_info of ...%s failed: %r", peer.to_base58()[-6:], e)
        return timeout_s
    return time.perf_counter() - began


async def measure_all(
    peers: list[str],
    connect: Callable[[str], Awaitable[PeerID]],
    p2p: P2P,
    timeout_s: float,
    record: Callable[[str, float], None],
    unanswered: Callable[[str], None],
) -> None:
    """Time one rpc_info of each peer concurrently (after connecting to it) and record(peer, seconds); a peer that
    cannot be connected to or does not answer within timeout_s is unanswered(peer)."""

    async def one(peer_id: str) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                peer = await connect(peer_id)
        except Exception as e:  # noqa: BLE001 - whatever fails, the server did not answer
            logger.debug("Connecting to ...%s failed: %r", peer_id[-6:], e)
            unanswered(peer_id)
            return
        seconds = await time_info_call(p2p, peer, timeout_s)
        if seconds >= timeout_s:
            unanswered(peer_id)
        else:
            record(peer_id, seconds)

    await asyncio.gather(*(one(peer) for peer in peers))
