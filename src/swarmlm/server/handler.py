"""The RPC surface of a server: parse and validate, hand to the backend, answer; nothing here touches weights."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarmlm.errors import LimitError, ProtocolError
from swarmlm.net.arrival import TIMEOUT_KIND, arriving
from swarmlm.net.peerlog import PEER_FAULTS
from swarmlm.protocol.codec import drain, encode, read_message, read_only_message
from swarmlm.protocol.messages import (
    BackwardRequest,
    ForwardRequest,
    InfoRequest,
    PushStep,
    ReplyHeader,
    ServerInfo,
)
from swarmlm.server.backend import Keeping, SpanBackend
from swarmlm.server.inference import InferenceSessions
from swarmlm.server.peers import refusal, short, where
from swarmlm.server.validation import check_lora, check_span_request, max_message_bytes

logger = logging.getLogger(__name__)

Parts = AsyncIterator[runtime_pb2.ExpertRequest]
Replies = AsyncIterator[runtime_pb2.ExpertResponse]


class SpanHandler:
    """Implements protocol.service.SpanService for the span served by `backend`."""

    def __init__(
        self, backend: SpanBackend, inference: InferenceSessions, request_timeout_s: float,
        describe: Callable[[], ServerInfo], *, arrival_timeout_s: float,
    ):  # fmt: skip
        self.backend, self.inference, self.describe = backend, inference, describe
        self.request_timeout_s = request_timeout_s  # a request arrives in full within this
        self.arrival_timeout_s = arrival_timeout_s  # and each of its parts after the first within this of the last
        self.max_request_bytes = max_message_bytes(backend.limits.max_tokens, backend.limits.hidden_size)
        self.served = 0  # requests answered successfully
        self.rejected = 0  # requests refused as bad or failed on this server
        self.tokens = 0  # tokens of the requests served (batch x length)
        self.in_flight = 0  # forward/backward requests being computed now (a draining server lets them finish)

    async def rpc_forward(self, requests: Parts, context: P2PContext) -> Replies:
        async for part in self._serve(requests, context, ForwardRequest):
            yield part

    async def rpc_backward(self, requests: Parts, context: P2PContext) -> Replies:
        async for part in self._serve(requests, context, BackwardRequest):
            yield part

    async def rpc_inference(self, requests: Parts, context: P2PContext) -> Replies:
        async for part in self.inference.serve(requests, context.remote_id.to_base58()):
            yield part

    async def rpc_push(self, requests: Parts, context: P2PContext) -> Replies:
        """Steps of open sessions from the previous server of their route, one stream per session and pusher: each
        is queued, then acknowledged (its output goes to the session's client and on to the next server, not back to
        the pusher). The stream ends when the pusher ends it, or after the session idle timeout without a step."""
        while True:
            try:
                async with contextlib.aclosing(arriving(requests, self.arrival_timeout_s)) as parts:
                    message = await asyncio.wait_for(
                        read_message(parts, PushStep, max_bytes=self.max_request_bytes), self.inference.idle_timeout_s
                    )
                if message is None:
                    return
                reply = self.inference.accept_push(*message)
            except TimeoutError:
                return
            except ProtocolError as e:
                peer = context.remote_id.to_base58()
                PEER_FAULTS.warning(logger, peer, "push rejected peer=...%s: %s", peer[-6:], short(str(e)))
                for part in encode(refusal(e), [], runtime_pb2.ExpertResponse):
                    yield part
                await self._drain(requests)
                return  # the stream itself is broken: nothing after this can be parsed
            for part in encode(reply, [], runtime_pb2.ExpertResponse):
                yield part

    async def rpc_info(self, requests: Parts, context: P2PContext) -> Replies:
        # the answer is public (the DHT record says most of it): whatever the request holds, it gets the answer,
        # once the request has been read (up to a deadline), so the asker's writes do not break its pipe
        with contextlib.suppress(asyncio.TimeoutError, ProtocolError):
            await asyncio.wait_for(read_only_message(requests, InfoRequest, max_bytes=0), self.request_timeout_s)
        for part in encode(self.describe(), [], runtime_pb2.ExpertResponse):
            yield part

    async def _serve(self, requests: Parts, context: P2PContext, header_type: type[ForwardRequest]) -> Replies:
        began = time.perf_counter()
        peer_id = context.remote_id.to_base58()
        peer = peer_id[-6:]
        kind = header_type.model_fields["kind"].default
        refused = False  # a refused request may still be arriving
        try:
            message = await self._read_request(requests, header_type)
            if message is None:
                raise ProtocolError("empty request stream")
            header, tensors = message
            inputs = check_span_request(header, tensors, self.backend.limits)
            lora = check_lora(
                header.lora, inputs.lora, header.start_block, header.end_block, self.backend.limits, header.adapter
            )
            key = header.kept if isinstance(header, BackwardRequest) else header.keep
            keeping = None if key is None else Keeping(peer_id, self.inference.ledger.host(peer_id), key)
            self.in_flight += 1
            try:
                bundle, compute_ms = await self.backend.run(
                    header.start_block, header.end_block, inputs, peer, header.adapter, lora, keeping,
                    host=self.inference.ledger.host(peer_id), owned=True,
                )  # fmt: skip
            finally:
                self.in_flight -= 1
            # answered as it was sent (int8 or not)
            reply = ReplyHeader(ok=True, tensors=bundle.names(), compute_ms=compute_ms, int8=header.int8)
            outputs = bundle.tensors()
            self.served += 1
            tokens = inputs.hidden.shape[0] * inputs.hidden.shape[1]
            self.tokens += tokens
            logger.debug(
                "%s blocks=%d:%d tokens=%d peer=...%s %.1f ms",
                kind, header.start_block, header.end_block, tokens, peer, (time.perf_counter() - began) * 1000,
            )  # fmt: skip
        except ProtocolError as e:
            self.rejected += 1
            PEER_FAULTS.warning(logger, peer_id, "%s rejected peer=...%s: %s", kind, peer, short(str(e)))
            reply = refusal(e)
            outputs, refused = [], True
        except Exception as e:  # noqa: BLE001 - any failure must become an error reply, never a dead server
            self.rejected += 1
            text = short(f"{type(e).__name__}: {e}")
            PEER_FAULTS.warning(logger, peer_id, "%s failed peer=...%s: %s\n%s", kind, peer, text, where(e))
            reply, outputs = ReplyHeader(ok=False, error=text, error_kind="server"), []
        for part in encode(reply, outputs, runtime_pb2.ExpertResponse):
            yield part
        if refused:
            await self._drain(requests)

    async def _read_request(
        self, requests: Parts, header_type: type[ForwardRequest]
    ) -> tuple[ForwardRequest, list] | None:
        """The one message of a forward or backward stream, in full within request_timeout_s, its parts following
        each other within arrival_timeout_s; LimitError of kind "timeout" when it does not arrive in time."""
        try:
            async with asyncio.timeout(self.request_timeout_s):
                async with contextlib.aclosing(arriving(requests, self.arrival_timeout_s)) as parts:
                    return await read_only_message(parts, header_type, max_bytes=self.max_request_bytes)
        except TimeoutError as e:
            raise LimitError(
                f"the request did not arrive in full in {self.request_timeout_s:g} s", TIMEOUT_KIND
            ) from e

    async def _drain(self, requests: Parts) -> None:
        """After a refusal is answered: read what the sender still sends (up to the deadline), so that its writes do
        not break its pipe before it reads the answer."""
        with contextlib.suppress(asyncio.TimeoutError, ProtocolError):
            await asyncio.wait_for(drain(requests, self.max_request_bytes), self.request_timeout_s)
