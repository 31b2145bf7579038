"""One remote call of a span: encode, send, await the reply, and turn every failure into a typed error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import torch
from hivemind.p2p import P2PDaemonError, P2PHandlerError
from hivemind.proto import runtime_pb2

from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.errors import BadRequestError, ProtocolError, RemoteCallError
from swarmlm.protocol import service
from swarmlm.protocol.codec import encode, read_only_message
from swarmlm.protocol.messages import ReplyHeader, _Header

# replies are never larger than this (hidden states of the largest request a server accepts, with room to spare)
MAX_REPLY_BYTES = 1 << 31


async def _as_stream(header: _Header, tensors: Sequence[torch.Tensor]) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    for part in encode(header, tensors, runtime_pb2.ExpertRequest):
        yield part


async def call_span(
    manager: SequenceManager, peer_id: str, method: str, header: _Header, tensors: Sequence[torch.Tensor]
) -> tuple[ReplyHeader, list[torch.Tensor]]:
    """Send one request to `method` on `peer_id` and return the reply; raises BadRequestError when the server
    rejected the request as invalid and RemoteCallError for any failure of the server or the connection."""
    began = time.perf_counter()
    try:
        async with asyncio.timeout(manager.config.request_timeout_s):
            peer = await manager.ensure_connected(peer_id)
            stub = service.stub(manager.p2p, peer)
            replies = await getattr(stub, method)(_as_stream(header, tensors))
            message = await read_only_message(replies, ReplyHeader, max_bytes=MAX_REPLY_BYTES)
    except TimeoutError as e:
        raise RemoteCallError(f"{method} timed out after {manager.config.request_timeout_s:.0f} s", peer_id) from e
    except (P2PDaemonError, P2PHandlerError, ConnectionError, OSError, asyncio.IncompleteReadError) as e:
        raise RemoteCallError(f"{method} failed: {type(e).__name__}: {e}", peer_id) from e
    except ProtocolError as e:
        raise RemoteCallError(f"{method} got a malformed reply: {e}", peer_id) from e
    if message is None:
        raise RemoteCallError(f"{method}: the server closed the stream without replying", peer_id)
    reply, outputs = message
    if not reply.ok:
        error_type = BadRequestError if reply.error_kind == "bad_request" else RemoteCallError
        raise error_type(f"server refused {method}: {reply.error}", peer_id)
    manager.record_success(peer_id, max(time.perf_counter() - began - reply.compute_ms / 1000, 0.0))
    return reply, outputs
