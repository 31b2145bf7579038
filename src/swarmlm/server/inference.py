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
from swarmlm.server.peers import LimitError, PeerLedger, refusal, short, where
from swarmlm.server.validation import check_open, check_step, max_message_bytes

logger = logging.getLogger(__name__)

Replies = AsyncIterator[runtime_pb2.ExpertResponse]
# longest wait for a client to finish sending after its stream was refused
DRAIN_TIMEOUT_S = 30.0


class InferenceSessions:
    """Serves inference streams: open (reserve cache) -> steps -> close (client ends the stream, or idle timeout)."""

    def __init__(
        self, backend: SpanBackend, budget: CacheBudget, ledger: PeerLedger, *, alloc_timeout_s: float,
        idle_timeout_s: float, chunk_tokens: int,
    ):  # fmt: skip
        self.backend, self.budget, self.ledger = backend, budget, ledger
        self.alloc_timeout_s, self.idle_timeout_s = alloc_timeout_s, idle_timeout_s
        self.chunk_tokens = chunk_tokens
        self.max_message_bytes = max_message_bytes(backend.limits.max_tokens, backend.limits.hidden_size)
        self.open_sessions = 0
        self.accepting = True  # False while the server drains: new sessions are refused as busy
        self._closing = asyncio.Event()  # set to close every open session (each is told "busy" and rebuilt elsewhere)

    def stop_accepting(self) -> None:
        self.accepting = False

    def close_all(self) -> None:
        """Close every open session at its next read; new sessions stay refused until reopen()."""
        self.accepting = False
        self._closing.set()

    def reopen(self) -> None:
        self.accepting = True
        self._closing = asyncio.Event()

    async def serve(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], peer: str) -> Replies:
        """One session of `peer` (its full id, the key of its limits)."""
        try:
            session = await self._open(requests, peer)
        except (ProtocolError, ServerBusyError, TimeoutError) as e:
            text = short(str(e) or "no open message in time")
            logger.warning("inference open refused peer=...%s: %s", peer[-6:], text)
            yield _reply(refusal(e, text))
            await self._drain(requests)
            return
        if session is None:
            return
        tokens = session.batch_size * session.max_length
        self.open_sessions += 1
        logger.info("inference open blocks=%d:%d batch=%d max_length=%d peer=...%s", session.start_block,
                    session.end_block, session.batch_size, session.max_length, peer[-6:])  # fmt: skip
        try:
            yield _reply(ReplyHeader(ok=True))
            async for part in self._steps(requests, session, peer[-6:]):
                yield part
        finally:
            self.open_sessions -= 1
            self.budget.release(tokens)
            self.ledger.add_cache(peer, -tokens)
            self.ledger.close_session(peer)
            logger.info("inference closed blocks=%d:%d peer=...%s", session.start_block, session.end_block, peer[-6:])

    async def _open(self, requests: AsyncIterator, peer: str) -> InferenceOpen | None:
        """Read the open message and reserve the session's place and cache; None if the stream ended first."""
        opened = await asyncio.wait_for(read_message(requests, InferenceOpen, max_bytes=0), self.idle_timeout_s)
        if opened is None:
            return None
        session, _ = opened
        if not self.accepting:
            raise LimitError("server busy: it is leaving these blocks", "busy")
        check_open(session, self.backend.limits)
        tokens = session.batch_size * session.max_length
        self.ledger.open_session(peer)
        try:
            self.ledger.check_cache(peer, tokens, self.budget.capacity)
            self.ledger.add_cache(peer, tokens)  # counted while waiting, so one peer cannot queue beyond its share
            try:
                await self.budget.reserve(tokens, self.alloc_timeout_s)
            except BaseException:
                self.ledger.add_cache(peer, -tokens)
                raise
        except BaseException:
            self.ledger.close_session(peer)
            raise
        return session

    async def _steps(self, requests: AsyncIterator, session: InferenceOpen, peer: str) -> Replies:
        cache = DynamicCache()
        while True:
            try:
                message = await self._next_step(requests)
            except _Closing:
                logger.info("inference session closed by the server (leaving its blocks) peer=...%s", peer)
                yield _reply(ReplyHeader(ok=False, error="server busy: it left these blocks", error_kind="busy"))
                return
            except TimeoutError:
                logger.info("inference session idle for %.0f s, closing peer=...%s", self.idle_timeout_s, peer)
                return
            except ProtocolError as e:
                yield _reply(refusal(e))
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
                logger.warning("inference step rejected peer=...%s: %s", peer, short(str(e)))
                # too_large: over this server's own limits (another server may take it)
                yield _reply(refusal(e))
                continue  # the cache is untouched: the session goes on
            before = _lengths(cache, session)
            try:
                outputs, compute_ms = await self.backend.step(
                    cache, session.start_block, session.end_block, inputs, self.chunk_tokens,
                    header.start_from_position, peer=peer, adapter=session.adapter,
                )
            except Exception as e:  # noqa: BLE001 - a failed step is answered; it never kills the stream raw
                intact = inputs.hypo_ids is None and _lengths(cache, session) == before
                text = short(f"{type(e).__name__}: {e}")
                logger.warning("inference step failed peer=...%s (%s): %s\n%s", peer,
                               "session goes on" if intact else "cache changed, closing", text, where(e))  # fmt: skip
                yield _reply(ReplyHeader(ok=False, error=text, error_kind="server"))
                if not intact:
                    return
                continue
            logger.info("inference step blocks=%d:%d tokens=%d past=%d peer=...%s %.1f ms",
                        session.start_block, session.end_block, inputs.hidden.shape[0] * inputs.hidden.shape[1],
                        past, peer, (time.perf_counter() - began) * 1000)  # fmt: skip
            for part in encode(ReplyHeader(ok=True, compute_ms=compute_ms), outputs, runtime_pb2.ExpertResponse):
                yield part

    async def _next_step(self, requests: AsyncIterator) -> tuple[InferenceStep, list] | None:
        """The next step (None: the client ended the stream); raises _Closing when close_all() comes first."""
        closing = self._closing
        if closing.is_set():
            raise _Closing
        read = asyncio.ensure_future(
            asyncio.wait_for(read_message(requests, InferenceStep, max_bytes=self.max_message_bytes),
                             self.idle_timeout_s)
        )  # fmt: skip
        closed = asyncio.ensure_future(closing.wait())
        try:
            await asyncio.wait({read, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            if not read.done():
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError, TimeoutError, ProtocolError):
                    await read
        if read.cancelled():
            raise _Closing
        return read.result()

    async def _drain(self, requests: AsyncIterator) -> None:
        """Read what the client still sends after an error reply, so that its writes do not break the reply."""
        with contextlib.suppress(TimeoutError, ProtocolError):
            await asyncio.wait_for(drain(requests, self.max_message_bytes), min(self.idle_timeout_s, DRAIN_TIMEOUT_S))


class _Closing(Exception):  # noqa: N818 - a signal between two methods, never raised out of this module
    """The server closes its sessions (it drains, then leaves or moves)."""


def _lengths(cache: DynamicCache, session: InferenceOpen) -> list[int]:
    """Tokens the cache holds in each of the session's blocks (all equal while it is consistent)."""
    return [cache.get_seq_length(block) for block in range(session.start_block, session.end_block)]


def _reply(header: ReplyHeader) -> runtime_pb2.ExpertResponse:
    (part,) = encode(header, [], runtime_pb2.ExpertResponse)
    return part
