"""Inference sessions on a server: one bidirectional stream per session, holding a KV cache between steps."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from hivemind.proto import runtime_pb2
from transformers.cache_utils import DynamicCache

from swarmlm.config import ServerConfig
from swarmlm.errors import ProtocolError
from swarmlm.models.growing_cache import GrowingCache
from swarmlm.net.arrival import arriving
from swarmlm.net.peerlog import PEER_FAULTS
from swarmlm.protocol.bundle import ReplyTensors, SpanTensors
from swarmlm.protocol.codec import drain, encode, read_message
from swarmlm.protocol.lora import LoraWeights
from swarmlm.protocol.messages import InferenceOpen, InferenceStep, PushHop, PushStep, ReplyHeader
from swarmlm.server.admission import SessionLengths, admit_now
from swarmlm.server.backend import SpanBackend
from swarmlm.server.cache import CacheBudget, ServerBusyError
from swarmlm.server.peers import Holding, LimitError, PeerLedger, refusal, short, where
from swarmlm.server.validation import check_lora, check_open, check_step, max_message_bytes

logger = logging.getLogger(__name__)

Replies = AsyncIterator[runtime_pb2.ExpertResponse]
# longest wait for a client to finish sending after its stream was refused
DRAIN_TIMEOUT_S = 30.0
# pushed steps a session holds before it runs them (a pusher that sends more is told the server is busy)
PUSH_QUEUE_STEPS = 2
# an open message is small: a stream that sends none for this long is closed (it holds a stream and nothing else)
OPEN_TIMEOUT_S = 30.0


class Pusher(Protocol):
    """Sends a pushed step to the next server of a route (server/push.py)."""

    async def __call__(self, hop: PushHop, header: PushStep, tensors: list) -> str | None:
        """None when the next server accepted the step, else why not."""
        ...

    def forget(self, session_id: str) -> None:
        """Close the stream to that session."""
        ...


Message = tuple[InferenceStep, list]


def cache_block_tokens(session: InferenceOpen) -> int:
    """What a session reserves of the cache budget: batch x max_length tokens at each block it uses (not at every
    block the server holds: a session over blocks 2:5 of a server holding 2:7 keeps nothing at blocks 5 and 6)."""
    return session.batch_size * session.max_length * (session.end_block - session.start_block)


class _Inbox:
    """What others do to one open session: the steps pushed to it, waiting to run; `overflowed` is set when a pusher
    sent more than it holds (a step was refused, so the session's steps can no longer follow each other: it closes),
    or when the server reclaims the session for a peer that waits (`reclaimed`: its client reopens it elsewhere)."""

    def __init__(self) -> None:
        self.steps: asyncio.Queue[Message] = asyncio.Queue(PUSH_QUEUE_STEPS)
        self.overflowed = asyncio.Event()
        self.reclaimed = False
        self.holding: Holding | None = None  # what the ledger knows of the session, to choose whom to reclaim

    def reclaim(self) -> None:
        self.reclaimed = True
        self.overflowed.set()

    def mark(self, busy: bool) -> None:
        """The session waits for its next step (idle from now), or runs one."""
        if self.holding is not None:
            self.holding.busy = busy
            self.holding.active_at = asyncio.get_running_loop().time()


class InferenceSessions:
    """Serves inference streams: open (reserve cache) -> steps -> close (client ends the stream, or idle timeout)."""

    def __init__(
        self, backend: SpanBackend, budget: CacheBudget, ledger: PeerLedger, *, alloc_timeout_s: float,
        idle_timeout_s: float, chunk_tokens: int, pusher: Pusher | None = None,
        arrival_timeout_s: float = ServerConfig.arrival_timeout_s,
    ):  # fmt: skip
        self.backend, self.budget, self.ledger = backend, budget, ledger
        self.alloc_timeout_s, self.idle_timeout_s = alloc_timeout_s, idle_timeout_s
        self.arrival_timeout_s = arrival_timeout_s  # a step's parts after its first follow each other within this
        self.chunk_tokens = chunk_tokens
        self.max_message_bytes = max_message_bytes(backend.limits.max_tokens, backend.limits.hidden_size)
        self.open_sessions = 0
        self.sessions_opened = 0  # in all, since the server started (server/activity.py)
        self.steps_served = 0  # steps answered
        self.step_tokens = 0  # tokens of those steps (batch x length)
        self.steps_failed = 0  # steps that failed here
        self.accepting = True  # False while the server drains: new sessions are refused as busy
        self._closing = asyncio.Event()  # set to close every open session (each is told "busy" and rebuilt elsewhere)
        self.pusher = pusher
        self._pushed: dict[str, _Inbox] = {}  # steps pushed to open sessions, by session id
        self.pushes_received = 0  # pushed steps accepted (stats: they show steps travelled server to server)
        self.lengths = SessionLengths()  # how long sessions stay open: a busy answer's retry hint

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
            PEER_FAULTS.warning(logger, peer, "inference open refused peer=...%s: %s", peer[-6:], text)
            reply = refusal(e, text)
            if reply.error_kind == "busy":  # when to come back: a full swarm tells its users how long to wait
                reply = reply.model_copy(update={"retry_after_s": self.lengths.retry_after_s(self.open_sessions)})
            yield _reply(reply)
            await self._drain(requests)
            return
        if session is None:
            return
        tokens = cache_block_tokens(session)
        inbox = _Inbox()
        if session.session_id is not None:
            self._pushed[session.session_id] = inbox
        loop_time = asyncio.get_running_loop().time()
        inbox.holding = self.ledger.hold(
            Holding(peer, self.ledger.host(peer), inbox.reclaim, loop_time, sessions=1, tokens=tokens)
        )
        held = _HeldLora(self.ledger, peer)
        opened_at = time.monotonic()
        self.open_sessions += 1
        self.sessions_opened += 1
        logger.debug("inference open blocks=%d:%d batch=%d max_length=%d peer=...%s", session.start_block,
                    session.end_block, session.batch_size, session.max_length, peer[-6:])  # fmt: skip
        try:
            yield _reply(ReplyHeader(ok=True))
            async for part in self._steps(requests, session, peer[-6:], inbox, held):
                yield part
        finally:
            self.ledger.drop(inbox.holding)
            held.release()
            if session.session_id is not None:
                self._pushed.pop(session.session_id, None)
            self.open_sessions -= 1
            self.lengths.end(time.monotonic() - opened_at)
            self.budget.release(tokens)
            self.ledger.add_cache(peer, -tokens)
            self.ledger.close_session(peer)
            logger.debug("inference closed blocks=%d:%d peer=...%s", session.start_block, session.end_block, peer[-6:])

    async def _open(self, requests: AsyncIterator, peer: str) -> InferenceOpen | None:
        """Read the open message and reserve the session's place and cache; None if the stream ended first."""
        opened = await asyncio.wait_for(
            read_message(requests, InferenceOpen, max_bytes=0), min(self.idle_timeout_s, OPEN_TIMEOUT_S)
        )
        if opened is None:
            return None
        session, _ = opened
        if not self.accepting:
            raise LimitError("server busy: it is leaving these blocks", "busy")
        check_open(session, self.backend.limits)
        if session.session_id is not None and session.session_id in self._pushed:
            raise ProtocolError("a session with this id is open already: ids are random, choose another")
        tokens = cache_block_tokens(session)
        # the common case, decided as the simulator decides it (server/admission.py): room now, first in line
        if (
            not self.budget.waiting
            and admit_now(self.ledger, self.budget.used, self.budget.capacity, peer, tokens) is None
        ):
            self.budget.take(tokens)
            self.ledger.add_cache(peer, tokens)
            return session
        # a full pool (this peer's host's share, or the server's) closes richer holders' idle sessions, then waits
        await self.ledger.admit_session(peer, self.alloc_timeout_s)
        try:
            await self.ledger.admit_cache(peer, tokens, self.budget.capacity, self.alloc_timeout_s)
            if self.budget.used + tokens > self.budget.capacity:
                self.ledger.make_room("cache", peer, self.budget.used + tokens - self.budget.capacity, False)
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

    def accept_push(self, header: PushStep, tensors: list) -> ReplyHeader:
        """Queue a step pushed by the previous server of a session's route; it runs as a step of that session. A step
        that finds the session's inbox full is refused, and the session closes at once with a busy error to its
        client: the pusher may have answered the client before reading this refusal (server/push.py), so the
        client would otherwise wait for this step's output until its deadline."""
        inbox = self._pushed.get(header.session_id)
        if inbox is None:
            return ReplyHeader(ok=False, error="no open session has this id", error_kind="bad_request")
        if inbox.steps.full():
            inbox.overflowed.set()
            return ReplyHeader(ok=False, error="server busy: the session has steps waiting", error_kind="busy")
        step = InferenceStep(tensors=header.tensors, start_from_position=header.start_from_position,
                             next_hops=header.next_hops, int8=header.int8)  # fmt: skip
        inbox.steps.put_nowait((step, tensors))
        self.pushes_received += 1
        return ReplyHeader(ok=True)

    async def _push_on(
        self, header: InferenceStep, inputs: SpanTensors, output: ReplyTensors, pushed_to: set[str]
    ) -> str | None:
        """Send a step's output to the next server of its route; None when it took it, else why not."""
        if self.pusher is None:
            return "this server does not push"
        if inputs.hypo_ids is not None or inputs.prompts is not None or inputs.lora is not None:
            return "steps that reorder caches or carry prompts or LoRA weights are not pushed"
        hop, rest = header.next_hops[0], header.next_hops[1:]
        pushed_to.add(hop.session_id)
        pushed = SpanTensors(
            output.required("hidden"), attention_mask=inputs.attention_mask, position_ids=inputs.position_ids
        )
        message = PushStep(tensors=pushed.names(), session_id=hop.session_id,
                           start_from_position=hop.start_from_position, next_hops=rest, int8=header.int8)  # fmt: skip
        return await self.pusher(hop, message, pushed.tensors())

    async def _steps(
        self, requests: AsyncIterator, session: InferenceOpen, peer: str, inbox: _Inbox,
        held: _HeldLora,
    ) -> Replies:  # fmt: skip
        cache = GrowingCache(max_tokens=session.max_length)
        reader = _Reader(requests, self.max_message_bytes, self.arrival_timeout_s)
        pushed_to: set[str] = set()  # sessions this one pushed steps to (their streams close with it)
        try:
            async for part in self._run_steps(reader, session, peer, inbox, cache, pushed_to, held):
                yield part
        finally:
            self.backend.session_ended(cache)
            await reader.cancel()
            if self.pusher is not None:
                for session_id in pushed_to:
                    self.pusher.forget(session_id)

    async def _run_steps(
        self, reader: _Reader, session: InferenceOpen, peer: str, inbox: _Inbox,
        cache: DynamicCache, pushed_to: set[str], held: _HeldLora,
    ) -> Replies:  # fmt: skip
        requests = reader.requests
        while True:
            try:
                message = await self._next_step(reader, inbox)
            except _Closing:
                logger.debug("inference session closed by the server (leaving its blocks) peer=...%s", peer)
                yield _reply(ReplyHeader(ok=False, error="server busy: it left these blocks", error_kind="busy"))
                return
            except _Overflowed:
                if inbox.reclaimed:
                    logger.info("inference session reclaimed for a waiting peer peer=...%s", peer)
                    error = "server busy: this session was reclaimed for a peer that waited (it was idle)"
                    yield _reply(ReplyHeader(ok=False, error=error, error_kind="busy"))
                    return
                PEER_FAULTS.warning(logger, peer, "inference session closed: steps were pushed to it faster than it "
                                    "runs them peer=...%s", peer[-6:])  # fmt: skip
                error = "server busy: steps were pushed to this session faster than it runs them (one was refused)"
                yield _reply(ReplyHeader(ok=False, error=error, error_kind="busy"))
                return
            except TimeoutError:
                logger.debug("inference session idle for %.0f s, closing peer=...%s", self.idle_timeout_s, peer)
                return
            except ProtocolError as e:
                PEER_FAULTS.warning(logger, peer, "inference stream refused peer=...%s: %s", peer[-6:], short(str(e)))
                yield _reply(refusal(e))
                await self._drain(requests)
                return  # the stream itself is broken: nothing after this can be parsed
            if message is None:
                return  # the client closed the session
            inbox.mark(busy=True)
            began = time.perf_counter()
            header, tensors = message
            past = cache.get_seq_length(session.start_block)
            try:
                inputs = check_step(header, tensors, self.backend.limits, session, past)
                start, end, limits = session.start_block, session.end_block, self.backend.limits
                brought = check_lora(header.lora, inputs.lora, start, end, limits, session.adapter)
                if brought is not None:  # they replace the session's: for this step and every later one
                    await held.replace(brought, self.alloc_timeout_s)
            except ProtocolError as e:
                PEER_FAULTS.warning(logger, peer, "inference step rejected peer=...%s: %s", peer[-6:], short(str(e)))
                # too_large: over this server's own limits (another server may take it)
                yield _reply(refusal(e))
                continue  # the cache is untouched: the session goes on
            before = _lengths(cache, session)
            try:
                bundle, compute_ms = await self.backend.step(
                    cache,
                    session.start_block,
                    session.end_block,
                    inputs,
                    self.chunk_tokens,
                    header.start_from_position,
                    peer=peer,
                    adapter=session.adapter,
                    lora=held.weights,
                    host=self.ledger.host(peer),
                )
            except Exception as e:  # noqa: BLE001 - a failed step is answered; it never kills the stream raw
                intact = inputs.hypo_ids is None and _lengths(cache, session) == before
                text = short(f"{type(e).__name__}: {e}")
                self.steps_failed += 1
                outcome = "session goes on" if intact else "cache changed, closing"
                PEER_FAULTS.warning(
                    logger, peer, "inference step failed peer=...%s (%s): %s\n%s", peer[-6:], outcome, text, where(e)
                )
                yield _reply(ReplyHeader(ok=False, error=text, error_kind="server"))
                if not intact:
                    return
                continue
            push_error = await self._push_on(header, inputs, bundle, pushed_to) if header.next_hops else None
            self.steps_served += 1
            self.step_tokens += inputs.hidden.shape[0] * inputs.hidden.shape[1]
            logger.debug("inference step blocks=%d:%d tokens=%d past=%d peer=...%s %.1f ms%s",
                        session.start_block, session.end_block, inputs.hidden.shape[0] * inputs.hidden.shape[1],
                        past, peer, (time.perf_counter() - began) * 1000,
                        f" push failed: {push_error}" if push_error else "")  # fmt: skip
            reply = ReplyHeader(
                ok=True, tensors=bundle.names(), compute_ms=compute_ms, push_error=push_error, int8=header.int8
            )
            for part in encode(reply, bundle.tensors(), runtime_pb2.ExpertResponse):
                yield part

    async def _next_step(self, reader: _Reader, inbox: _Inbox | None) -> Message | None:
        """The next step, from the client or pushed by the previous server (None: the client ended the stream);
        raises _Closing when close_all() comes first, _Overflowed once a pushed step was refused for want of room or
        the session was reclaimed, TimeoutError after idle_timeout_s without a step."""
        if inbox is not None:
            inbox.mark(busy=False)
        closing = self._closing
        if closing.is_set():
            raise _Closing
        if inbox is not None and inbox.overflowed.is_set():
            raise _Overflowed
        read = reader.next()
        closed = asyncio.ensure_future(closing.wait())
        waiting: set[asyncio.Future[Any]] = {read, closed}
        pushed: asyncio.Future[Message] | None = None
        overflowed: asyncio.Future[Any] | None = None
        if inbox is not None:
            pushed = asyncio.ensure_future(inbox.steps.get())
            overflowed = asyncio.ensure_future(inbox.overflowed.wait())
            waiting |= {pushed, overflowed}
        try:
            done, _ = await asyncio.wait(waiting, timeout=self.idle_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            if overflowed is not None:
                overflowed.cancel()
            if pushed is not None and not pushed.done():
                pushed.cancel()
        if overflowed is not None and overflowed in done:
            raise _Overflowed
        if pushed is not None and pushed in done:
            return pushed.result()  # a read that finished too stays for the next call
        if read in done:
            return reader.take()
        if closed in done:
            raise _Closing
        raise TimeoutError

    async def _drain(self, requests: AsyncIterator) -> None:
        """Read what the client still sends after an error reply, so that its writes do not break the reply."""
        with contextlib.suppress(TimeoutError, ProtocolError):
            await asyncio.wait_for(drain(requests, self.max_message_bytes), min(self.idle_timeout_s, DRAIN_TIMEOUT_S))


class _HeldLora:
    """A session's own LoRA weights (from the last step that brought some), counted against its peer's memory bound
    (--peer-memory-mb) for as long as the session holds them."""

    def __init__(self, ledger: PeerLedger, peer: str):
        self.ledger, self.peer = ledger, peer
        self.weights: LoraWeights | None = None
        self._bytes = 0

    async def replace(self, weights: LoraWeights, timeout_s: float) -> None:
        """Hold `weights` instead of the current ones; LimitError (the current ones stay) if the peer has no room."""
        size = weights.flat.numel() * weights.flat.element_size()
        await self.ledger.acquire_bytes(self.peer, size, timeout_s)
        self.release()
        self.weights, self._bytes = weights, size

    def release(self) -> None:
        self.ledger.release_bytes(self.peer, self._bytes)
        self.weights, self._bytes = None, 0


class _Reader:
    """Reads a session's steps from its client's stream; a read interrupted by a pushed step goes on, to be taken
    by a later call (a message half read must never be dropped)."""

    def __init__(self, requests: AsyncIterator, max_bytes: int, arrival_timeout_s: float):
        self.requests, self.max_bytes, self.arrival_timeout_s = requests, max_bytes, arrival_timeout_s
        self._read: asyncio.Future[Message | None] | None = None

    def next(self) -> asyncio.Future[Message | None]:
        if self._read is None:
            self._read = asyncio.ensure_future(self._read_step())
        return self._read

    async def _read_step(self) -> Message | None:
        """The next step: whenever its first part comes, the others each within arrival_timeout_s."""
        async with contextlib.aclosing(arriving(self.requests, self.arrival_timeout_s)) as parts:
            return await read_message(parts, InferenceStep, max_bytes=self.max_bytes)

    def take(self) -> Message | None:
        read, self._read = self._read, None
        if read is None:
            raise RuntimeError("no read to take")
        return read.result()

    async def cancel(self) -> None:
        """Stop the read in progress. A read that already failed (the peer broke the stream as the session ended) has
        its error taken here: left untaken, asyncio would log it with a traceback when the read is collected."""
        read, self._read = self._read, None
        if read is None:
            return
        if read.done():
            if not read.cancelled():
                read.exception()  # taken (None after a clean read): the session is over, so is what it read
            return
        read.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError, ProtocolError):
            await read


class _Closing(Exception):  # a signal between two methods, never raised out of this module
    """The server closes its sessions (it drains, then leaves or moves)."""


class _Overflowed(Exception):  # a signal between two methods, never raised out of this module
    """A step pushed to the session was refused: its inbox was full."""


def _lengths(cache: DynamicCache, session: InferenceOpen) -> list[int]:
    """Tokens the cache holds in each of the session's blocks (all equal while it is consistent)."""
    return [cache.get_seq_length(block) for block in range(session.start_block, session.end_block)]


def _reply(header: ReplyHeader) -> runtime_pb2.ExpertResponse:
    (part,) = encode(header, [], runtime_pb2.ExpertResponse)
    return part
