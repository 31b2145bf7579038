"""Inference sessions on a server: one bidirectional stream per session, holding a KV cache between steps."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from hivemind.proto import runtime_pb2
from transformers.cache_utils import DynamicCache

from swarmlm.errors import ProtocolError
from swarmlm.protocol.codec import drain, encode, read_message
from swarmlm.protocol.messages import InferenceOpen, InferenceStep, ReplyHeader
from swarmlm.server.backend import SpanBackend
from swarmlm.server.cache import CacheBudget, ServerBusyError
from swarmlm.server.validation import check_open, check_step, max_message_bytes

logger = logging.getLogger(__name__)

Replies = AsyncIterator[runtime_pb2.ExpertResponse]
# longest wait for a client to finish sending after its stream was refused
DRAIN_TIMEOUT_S = 30.0


class InferenceSessions:
    """Serves inference streams: open (reserve cache) -> steps -> close (client ends the stream, or idle timeout)."""

    def __init__(
        self, backend: SpanBackend, budget: CacheBudget, *, alloc_timeout_s: float, idle_timeout_s: float,
        chunk_tokens: int,
    ):  # fmt: skip
        self.backend, self.budget = backend, budget
        self.alloc_timeout_s, self.idle_timeout_s = alloc_timeout_s, idle_timeout_s
        self.chunk_tokens = chunk_tokens
        self.max_message_bytes = max_message_bytes(backend.limits.max_tokens, backend.limits.hidden_size)
        self.open_sessions = 0

    async def serve(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], peer: str) -> Replies:
        try:
            opened = await asyncio.wait_for(
                read_message(requests, InferenceOpen, max_bytes=0), timeout=self.idle_timeout_s
            )
            if opened is None:
                return
            session, _ = opened
            check_open(session, self.backend.limits)
            tokens = session.batch_size * session.max_length
            await self.budget.reserve(tokens, self.alloc_timeout_s)
        except (ProtocolError, ServerBusyError, TimeoutError) as e:
            kind = "busy" if isinstance(e, ServerBusyError) else "bad_request"
            logger.warning("inference open refused peer=...%s: %s", peer, e)
            yield _reply(ReplyHeader(ok=False, error=str(e) or "no open message in time", error_kind=kind))
            await self._drain(requests)
            return
        self.open_sessions += 1
        logger.info("inference open blocks=%d:%d batch=%d max_length=%d peer=...%s",
                    session.start_block, session.end_block, session.batch_size, session.max_length, peer)  # fmt: skip
        try:
            yield _reply(ReplyHeader(ok=True))
            async for part in self._steps(requests, session, peer):
                yield part
        finally:
            self.open_sessions -= 1
            await self.budget.release(tokens)
            logger.info("inference closed blocks=%d:%d peer=...%s", session.start_block, session.end_block, peer)

    async def _steps(self, requests: AsyncIterator, session: InferenceOpen, peer: str) -> Replies:
        cache = DynamicCache()
        while True:
            try:
                message = await asyncio.wait_for(
                    read_message(requests, InferenceStep, max_bytes=self.max_message_bytes), self.idle_timeout_s
                )
            except TimeoutError:
                logger.info("inference session idle for %.0f s, closing peer=...%s", self.idle_timeout_s, peer)
                return
            except ProtocolError as e:
                yield _reply(ReplyHeader(ok=False, error=str(e), error_kind="bad_request"))
                await self._drain(requests)
                return  # the stream itself is broken: nothing after this can be parsed
            if message is None:
                return  # the client closed the session
            began = time.perf_counter()
            header, tensors = message
            past = cache.get_seq_length(session.start_block)
            try:
                inputs = check_step(header, tensors, self.backend.limits, session, past)
            except ProtocolError as e:
                logger.warning("inference step rejected peer=...%s: %s", peer, e)
                yield _reply(ReplyHeader(ok=False, error=str(e), error_kind="bad_request"))
                continue  # the cache is untouched: the session goes on
            outputs, compute_ms = await self.backend.step(
                cache, session.start_block, session.end_block, inputs, self.chunk_tokens, header.start_from_position
            )
            logger.info("inference step blocks=%d:%d tokens=%d past=%d peer=...%s %.1f ms",
                        session.start_block, session.end_block, inputs.hidden.shape[0] * inputs.hidden.shape[1],
                        past, peer, (time.perf_counter() - began) * 1000)  # fmt: skip
            for part in encode(ReplyHeader(ok=True, compute_ms=compute_ms), outputs, runtime_pb2.ExpertResponse):
                yield part

    async def _drain(self, requests: AsyncIterator) -> None:
        """Read what the client still sends after an error reply, so that its writes do not break the reply."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(drain(requests, self.max_message_bytes), min(self.idle_timeout_s, DRAIN_TIMEOUT_S))


def _reply(header: ReplyHeader) -> runtime_pb2.ExpertResponse:
    (part,) = encode(header, [], runtime_pb2.ExpertResponse)
    return part
