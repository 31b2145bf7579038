"""Noticing a server that went silent mid-request: a hung process or a pulled cable closes no connection, so
without this a client would wait out its whole request timeout before it re-routes.

While a reply is awaited longer than `liveness_check_s`, the client asks the server for its info (rpc_info, which
a server answers from its event loop even while its compute thread is busy with a long request). A server that
does not answer that ping within `liveness_check_s` more counts as failed; one that answers is busy, not gone, and
the wait goes on (up to the request's own deadline)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.errors import RemoteCallError

T = TypeVar("T")


async def watched(awaitable: Awaitable[T], manager: SequenceManager, peers: Sequence[str]) -> T:
    """The result of `awaitable` (a wait for the reply of `peers`, the servers it depends on); RemoteCallError naming
    the silent server as soon as one of them stops answering pings. Cancelling the wait cancels the awaitable."""
    interval = manager.config.liveness_check_s
    task = asyncio.ensure_future(awaitable)
    if interval <= 0:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval)
            if done:
                return task.result()
            for peer_id in peers:
                await _ping_or_fail(task, manager, peer_id, interval)
                if task.done():
                    return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _ping_or_fail(task: asyncio.Future[T], manager: SequenceManager, peer_id: str, timeout_s: float) -> None:
    """Return when the server answered a ping or the awaited reply arrived; raise RemoteCallError if neither
    happens within timeout_s or the ping fails."""
    # imported here: span_call uses this module
    from swarmlm.client.span_call import fetch_info

    ping = asyncio.ensure_future(fetch_info(manager, peer_id))
    try:
        waits: set[asyncio.Future[Any]] = {task, ping}
        done, _ = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return
        if ping in done:
            try:
                ping.result()
                return
            except RemoteCallError as e:
                # the wait itself may have just ended too: its own outcome (reply or error) tells more
                if task.done():
                    return
                raise RemoteCallError(f"the server stopped answering mid-request ({e})", peer_id) from e
        raise RemoteCallError(
            f"the server stopped answering mid-request: no reply and no answer to a ping for {2 * timeout_s:.0f} s",
            peer_id,
        )
    finally:
        if not ping.done():
            ping.cancel()
            with contextlib.suppress(BaseException):
                await ping
