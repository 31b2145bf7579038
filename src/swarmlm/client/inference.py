"""Client inference sessions: server-side KV caches along a route, with failover by replaying history."""

from __future__ import annotations

from dataclasses import replace

import torch

from swarmlm.client.chain import RetryBudget
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.span_call import SpanStream
from swarmlm.errors import RemoteCallError, SessionClosedError
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.protocol.messages import InferenceOpen, InferenceStep
from swarmlm.swarm.routing import RouteSpan


class _SpanSession:
    """One server's part of a session, with every input it has been sent (to rebuild it elsewhere)."""

    def __init__(self, manager: SequenceManager, span: RouteSpan, session_start: int):
        self.span, self.session_start = span, session_start
        self.stream = SpanStream(manager, span.peer_id, "rpc_inference")
        self.history: list[SpanTensors] = []  # each step as this span received it

    async def open(self, batch_size: int, max_length: int) -> None:
        header = InferenceOpen(
            start_block=self.span.start, end_block=self.span.end, batch_size=batch_size, max_length=max_length
        )
        await self.stream.exchange(header, [])

    async def step(self, inputs: SpanTensors) -> torch.Tensor:
        """Send one step (inputs.hidden: this span's input; inputs.prompts: the whole session's) and return its
        output hidden states."""
        sent = inputs
        if inputs.prompts is not None:
            offset = self.span.start - self.session_start
            sent = replace(inputs, prompts=inputs.prompts[offset : offset + self.span.end - self.span.start])
        outputs = await self.stream.exchange(InferenceStep(tensors=sent.names()), sent.tensors())
        if len(outputs) != 1 or outputs[0].shape != inputs.hidden.shape:
            raise RemoteCallError(f"inference reply has shapes {[tuple(o.shape) for o in outputs]}", self.span.peer_id)
        self.history.append(inputs)
        return outputs[0]


class InferenceSession:
    """Token-by-token passes through blocks [start, end) with KV caches kept by the servers.

    The route is opened at the first step (when the batch size is known). When a server fails, its blocks are
    re-opened on a new route and the inputs it had seen are replayed, so the caches and the results are as if
    nothing had happened.
    """

    def __init__(self, manager: SequenceManager, start: int, end: int, max_length: int):
        self.manager, self.start, self.end, self.max_length = manager, start, end, max_length
        self.position = 0  # tokens processed so far
        self.batch_size: int | None = None
        self._spans: list[_SpanSession] = []
        self.closed = False

    async def step(self, inputs: SpanTensors) -> torch.Tensor:
        """Hidden states of the new tokens after the session's blocks; inputs.hidden is (batch, new tokens, hidden),
        the other tensors of the bundle travel to every span (prompts cover the session's blocks)."""
        hidden = inputs.hidden
        if self.closed:
            raise SessionClosedError("this inference session is closed")
        if self.position + hidden.shape[1] > self.max_length:
            raise ValueError(
                f"{self.position + hidden.shape[1]} tokens exceed the session's max_length {self.max_length}"
            )
        retry = RetryBudget(self.manager)
        if self.batch_size is None:
            self.batch_size = hidden.shape[0]
            self._spans = await self._open_chain(self.start, self.end, retry)
        index = 0
        while index < len(self._spans):
            span_session = self._spans[index]
            try:
                out = await span_session.step(replace(inputs, hidden=hidden))
            except RemoteCallError as e:
                retry.failed(span_session.span, e)
                await span_session.stream.close()
                self._spans[index : index + 1] = await self._rebuild(span_session, retry)
                continue
            hidden, index = out, index + 1
        self.position += hidden.shape[1]
        return hidden

    async def _open_chain(self, start: int, end: int, retry: RetryBudget) -> list[_SpanSession]:
        opened, position = [], start
        while position < end:
            for span in await self.manager.make_route(position, end, tokens=self.batch_size):
                span_session = _SpanSession(self.manager, span, self.start)
                try:
                    await span_session.open(self.batch_size, self.max_length)
                except RemoteCallError as e:
                    await span_session.stream.close()
                    retry.failed(span, e)
                    break
                opened.append(span_session)
                position = span.end
        return opened

    async def _rebuild(self, lost: _SpanSession, retry: RetryBudget) -> list[_SpanSession]:
        """Sessions on a new route for the lost span's blocks, their caches rebuilt from the lost span's inputs."""
        while True:
            replacement = await self._open_chain(lost.span.start, lost.span.end, retry)
            try:
                for inputs in lost.history:
                    hidden = inputs.hidden
                    for span_session in replacement:
                        hidden = await span_session.step(replace(inputs, hidden=hidden))
                return replacement
            except RemoteCallError as e:
                failed = next((s.span for s in replacement if s.span.peer_id == e.peer_id), lost.span)
                retry.failed(failed, e)
                for span_session in replacement:
                    await span_session.stream.close()

    async def close(self) -> None:
        self.closed = True
        for span_session in self._spans:
            await span_session.stream.close()
        self._spans = []
