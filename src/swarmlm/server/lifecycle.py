"""A server's moves in the swarm: claim a span when joining, drain before leaving or moving, decide to move."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping

from hivemind.utils import get_dht_time

from swarmlm.server.handler import SpanHandler
from swarmlm.server.inference import InferenceSessions
from swarmlm.server.placement import Span, choose_span, claimed_first
from swarmlm.swarm.records import ServerRecord

logger = logging.getLogger(__name__)

# after announcing a claim, a server waits this long (uniformly drawn, in seconds) before re-reading the swarm: long
# enough for the claims of servers started at the same moment to be stored, random so that they do not re-read in step
CLAIM_WAIT_S = (0.5, 1.5)
# contested claims settle in about one round per contender; the bound keeps a confused swarm from looping forever
MAX_CLAIM_ROUNDS = 8
# how often a draining server looks whether its sessions and requests are done
DRAIN_POLL_S = 0.1
# after closing its remaining sessions, how long their streams get to tell the clients
CLOSE_GRACE_S = 2.0

ReadSwarm = Callable[[], Awaitable[Mapping[str, ServerRecord]]]
Claim = Callable[[Span, float], Awaitable[ServerRecord]]  # announce JOINING on a span since a time; the record


async def claim_wait() -> None:
    await asyncio.sleep(random.uniform(*CLAIM_WAIT_S))  # jitter, not cryptography


async def claim_span(read: ReadSwarm, claim: Claim, num_blocks_total: int, n: int, me: str) -> tuple[Span, float]:
    """Choose n blocks where the swarm is weakest and claim them (JOINING); if a server that claimed the same span
    first shows up, choose again with it counted. Returns the span and the time it was claimed."""
    span, since = (0, n), get_dht_time()
    for _ in range(MAX_CLAIM_ROUNDS):
        span, since = choose_span(num_blocks_total, n, await read(), me=me), get_dht_time()
        mine = await claim(span, since)
        await claim_wait()
        if not claimed_first(me, mine, await read()):
            return span, since
        logger.info("Blocks %d:%d were claimed first by another server; choosing again", *span)
    logger.warning("Placement did not settle in %d rounds; keeping blocks %d:%d", MAX_CLAIM_ROUNDS, *span)
    return span, since


async def drain(inference: InferenceSessions, handler: SpanHandler, timeout_s: float) -> None:
    """Take no new sessions; let open sessions and requests in flight finish for up to timeout_s, then close the
    sessions still open (their clients rebuild them on other servers)."""
    loop = asyncio.get_running_loop()
    inference.stop_accepting()
    deadline = loop.time() + timeout_s
    await _wait_until(lambda: inference.open_sessions == 0 and handler.in_flight == 0, deadline)
    if inference.open_sessions:
        logger.info("Closing %d inference sessions still open after %.0f s", inference.open_sessions, timeout_s)
        inference.close_all()
        await _wait_until(lambda: inference.open_sessions == 0, loop.time() + CLOSE_GRACE_S)


async def _wait_until(done: Callable[[], bool], deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while not done() and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)


def rebalance_delay(interval_s: float) -> float:
    """Seconds to the next rebalance check: the interval, jittered so that servers do not check (and move) in step."""
    return interval_s * random.uniform(0.5, 1.5)  # jitter, not cryptography
