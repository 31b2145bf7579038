"""Client inference sessions: server-side KV caches along a route; all-or-nothing steps, rollback and failover."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from swarmlm.client.chain import RetryBudget
from swarmlm.client.loop import LoopThread
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.span_call import SpanStream
from swarmlm.errors import BadRequestError, RemoteCallError, SessionClosedError
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.protocol.messages import InferenceOpen, InferenceStep
from swarmlm.swarm.routing import RouteSpan

logger = logging.getLogger(__name__)


def cut_step(step: SpanTensors, begin: int, keep: int) -> SpanTensors:
    """The first `keep` tokens of a step that started at token `begin` (keep may be 0: then only its hypo_ids
    remain, since the cache rows it reordered are still reordered after the cut)."""
    if keep == 0:
        return SpanTensors(step.hidden[:, :0], hypo_ids=step.hypo_ids)
    mask, positions = step.attention_mask, step.position_ids
    return replace(
        step,
        hidden=step.hidden[:, :keep],
        attention_mask=None if mask is None else mask[:, : begin + keep],  # (batch, past + new)
        position_ids=None if positions is None else positions[:, :keep],
    )


def cut_history(history: list[SpanTensors], tokens: int) -> list[SpanTensors]:
    """The steps that rebuild a cache cut back to `tokens` tokens: whole steps before the cut, the cut step's head,
    and the reorders (hypo_ids) of the steps after it."""
    kept, begin = [], 0
    for step in history:
        seq = step.hidden.shape[1]
        if begin + seq <= tokens:
            kept.append(step)
        elif begin < tokens or (step.hypo_ids is not None and tokens > 0):
            kept.append(cut_step(step, begin, max(tokens - begin, 0)))
        begin += seq
    return kept


class _SpanSession:
    """One server's part of a session: its stream, the steps its cache holds (to rebuild it elsewhere), and what
    the server holds beyond them after a failed or rolled-back step."""

    def __init__(self, manager: SequenceManager, span: RouteSpan, session_start: int):
        self.span, self.session_start = span, session_start
        self.stream = SpanStream(manager, span.peer_id, "rpc_inference")
        self.history: list[SpanTensors] = []  # committed steps as this span received them (session-wide prompts)
        self.tokens = 0  # tokens the server's cache holds (more than the session's position after a failed step)
        self.pending: SpanTensors | None = None  # a step this server ran that the session has not committed
        self.broken = False  # the stream failed: the server's cache is lost to us

    async def open(self, batch_size: int, max_length: int) -> None:
        header = InferenceOpen(
            start_block=self.span.start, end_block=self.span.end, batch_size=batch_size, max_length=max_length
        )
        await self.stream.exchange(header, [])

    async def send(self, inputs: SpanTensors, start_from: int | None = None) -> torch.Tensor:
        """Run one step (inputs.prompts: the whole session's; this span gets its blocks' rows) and return its output
        hidden states; start_from first cuts the server's cache back to that many tokens."""
        sent = inputs
        if inputs.prompts is not None:
            offset = self.span.start - self.session_start
            sent = replace(inputs, prompts=inputs.prompts[offset : offset + self.span.end - self.span.start])
        header = InferenceStep(tensors=sent.names(), start_from_position=start_from)
        outputs = await self.stream.exchange(header, sent.tensors())
        if len(outputs) != 1 or outputs[0].shape != inputs.hidden.shape:
            raise RemoteCallError(f"inference reply has shapes {[tuple(o.shape) for o in outputs]}", self.span.peer_id)
        return outputs[0]

    async def close(self) -> None:
        await self.stream.close()


class InferenceSession:
    """Token-by-token passes through blocks [start, end) with KV caches kept by the servers.

    A step is all or nothing: it returns only once every block has run it, and then the position advances. When a
    server fails, its blocks are re-opened elsewhere and the steps it had seen are replayed; when that is impossible
    the step raises and the position stays, and the next step first brings every server back to that position
    (cutting caches that ran the failed step, rebuilding those it reordered or lost). Setting `position` lower rolls
    the caches back. Use it as a context manager, or call close().
    """

    def __init__(
        self, manager: SequenceManager, loop: LoopThread, start: int, end: int, max_length: int,
        active: list[InferenceSession] | None = None,
    ):  # fmt: skip
        self.manager, self.loop, self.start, self.end, self.max_length = manager, loop, start, end, max_length
        self.batch_size: int | None = None  # known once the route is open
        self.closed = False
        self.prefix_tokens = 0  # positions taken by a model's prompt-tuning prefix before its first token
        self.token_ids: torch.Tensor | None = None  # (batch, tokens) ids the model's forward has processed
        self.output_ids: torch.Tensor | None = None  # (batch, tokens) the last generate()'s sequences
        self.output_mask: torch.Tensor | None = None  # (batch, tokens) attention mask of output_ids
        self._position = 0
        self._spans: list[_SpanSession] = []
        self._active = active  # the owner's sessions open in `with` blocks (generate() uses the innermost)

    @property
    def route(self) -> list[RouteSpan]:
        """The servers holding this session's caches now, in block order (empty before the first step)."""
        return [span_session.span for span_session in self._spans]

    @property
    def position(self) -> int:
        """Tokens the session holds (processed by every block)."""
        return self._position

    @position.setter
    def position(self, tokens: int) -> None:
        """Roll back to `tokens` tokens: the servers cut their caches at the next step."""
        self._check_open()
        if not 0 <= tokens <= self._position:
            raise ValueError(f"position must lie in [0, {self._position}], got {tokens}")
        for span_session in self._spans:
            span_session.history = cut_history(span_session.history, tokens)
        self._position = tokens
        keep = max(tokens - self.prefix_tokens, 0)
        for name in ("token_ids", "output_ids", "output_mask"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[:, :keep])

    def step(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states (batch, new tokens, hidden) after the session's blocks for the new tokens' inputs.

        prompts: deep prompts of the session's blocks, (blocks, prefix, hidden) or (blocks, batch, prefix, hidden);
        hypo_ids (batch,): cache rows to continue from (beam search); attention_mask (batch, position + new tokens);
        position_ids (batch, new tokens).
        """
        if hidden.ndim != 3:
            raise ValueError(f"hidden states must be (batch, seq, hidden), got {tuple(hidden.shape)}")
        blocks = self.end - self.start
        if prompts is not None and (prompts.ndim not in (3, 4) or prompts.shape[0] != blocks):
            raise ValueError(f"prompts must be ({blocks}, prefix, hidden) or ({blocks}, batch, prefix, hidden)")
        inputs = SpanTensors(
            hidden.detach().cpu(), attention_mask=attention_mask, position_ids=position_ids, hypo_ids=hypo_ids,
            prompts=None if prompts is None else prompts.detach().cpu(),
        )  # fmt: skip
        return self.loop.run(self.astep(inputs)).to(hidden.device)

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError("this inference session is closed")

    async def astep(self, inputs: SpanTensors) -> torch.Tensor:
        """step() on the client's loop: inputs.hidden (batch, new tokens, hidden) with what travels with it.

        A step with more tokens than one request may carry (the client's max_tokens_per_request, and what the
        servers announce they accept) runs as consecutive sub-steps; if one fails, the session is cut back to where
        the step began, so a step still either happens whole or not at all."""
        batch, seq = inputs.hidden.shape[:2]
        rows = max(1, self.manager.request_limit(self.start, self.end) // max(batch, 1))
        if seq <= rows:
            return await self._astep_whole(inputs)
        began, outputs = self._position, []
        try:
            for begin in range(0, seq, rows):
                outputs.append(await self._astep_whole(_tokens(inputs, begin, min(seq, begin + rows), began)))
        except BaseException:
            if self._position != began and not self.closed:
                self.position = began  # the next step cuts the servers' caches back to here
            raise
        return torch.cat(outputs, dim=1)

    async def _astep_whole(self, inputs: SpanTensors) -> torch.Tensor:
        self._check_open()
        batch, seq = inputs.hidden.shape[:2]
        if self._position + seq > self.max_length:
            raise ValueError(f"{self._position + seq} tokens exceed the session's max_length {self.max_length}")
        if self.batch_size is not None and batch != self.batch_size:
            raise ValueError(f"step has batch {batch}; the session was opened for batch {self.batch_size}")
        behind = any(s.tokens != self._position or s.pending is not None or s.broken for s in self._spans)
        if seq == 0 and inputs.hypo_ids is None and not behind:
            return inputs.hidden  # nothing to compute, nothing to cut: no call
        retry = RetryBudget(self.manager)
        if not self._spans:
            self._spans = await self._open_chain(self.start, self.end, batch, retry)
            self.batch_size = batch
        await self._repair(retry)
        hidden = await self._run_spans(inputs, retry)
        for span_session in self._spans:
            if span_session.pending is None:  # _run_spans leaves every span holding the step it ran
                raise RuntimeError(f"inference span {span_session.span.start}:{span_session.span.end} ran no step")
            if seq or inputs.hypo_ids is not None:  # an empty step that only cut the caches leaves no trace
                span_session.history.append(span_session.pending)
            span_session.pending = None
        self._position += seq
        return hidden

    async def _run_spans(self, inputs: SpanTensors, retry: RetryBudget) -> torch.Tensor:
        """The step through every span, re-opening failed ones; each span keeps what it ran as pending."""
        hidden, index, covered = inputs.hidden, 0, self.start
        while index < len(self._spans):
            span_session = self._spans[index]
            sent = replace(inputs, hidden=hidden)
            start_from = None if span_session.tokens == self._position else self._position
            try:
                out = await span_session.send(sent, start_from)
            except BadRequestError:
                raise  # the server kept its cache as it was; spans before this one are cut back at the next step
            except RemoteCallError as e:
                span_session.broken = True
                await span_session.close()
                retry.failed(span_session.span, e)
                self._spans[index : index + 1] = await self._rebuild(span_session, retry)
                continue
            span_session.pending, span_session.tokens = sent, self._position + hidden.shape[1]
            if span_session.span.start != covered:
                raise RuntimeError(f"inference route skipped blocks {covered}:{span_session.span.start}")
            hidden, index, covered = out, index + 1, span_session.span.end
        if covered != self.end:  # never return hidden states that missed a block
            raise RuntimeError(f"inference step ran blocks {self.start}:{covered} of {self.start}:{self.end}")
        return hidden

    async def _repair(self, retry: RetryBudget) -> None:
        """Bring every span to the session's position after a failed step: a span that ran it without reordering
        its cache is cut back by its next step; one that reordered it, or whose server was lost, is rebuilt."""
        repaired: list[_SpanSession] = []
        for index, span_session in enumerate(self._spans):
            if span_session.pending is not None and span_session.pending.hypo_ids is None:
                span_session.pending = None
            if span_session.pending is None and not span_session.broken:
                repaired.append(span_session)
                continue
            if not span_session.broken:
                span_session.broken = True
                await span_session.close()
            try:
                repaired.extend(await self._rebuild(span_session, retry))
            except BaseException:
                self._spans = repaired + self._spans[index:]  # this one stays broken: the next step retries
                raise
        self._spans = repaired

    async def _open_chain(self, start: int, end: int, batch: int, retry: RetryBudget) -> list[_SpanSession]:
        """Sessions over blocks [start, end) on a new route; on failure, every stream opened here is closed."""
        opened: list[_SpanSession] = []
        try:
            position = start
            while position < end:
                for span in await retry.route(position, end, tokens=batch, session_tokens=batch * self.max_length):
                    span_session = _SpanSession(self.manager, span, self.start)
                    try:
                        await span_session.open(batch, self.max_length)
                    except RemoteCallError as e:
                        await span_session.close()
                        retry.failed(span, e)
                        break
                    opened.append(span_session)
                    position = span.end
            return opened
        except BaseException:
            await _close_all(opened)
            raise

    async def _rebuild(self, lost: _SpanSession, retry: RetryBudget) -> list[_SpanSession]:
        """Sessions on a new route for the lost span's blocks, their caches rebuilt from the steps it had committed."""
        if self.batch_size is None:
            raise RuntimeError("only a span of an open inference route can be rebuilt")
        while True:
            replacement = await self._open_chain(lost.span.start, lost.span.end, self.batch_size, retry)
            try:
                for step in lost.history:
                    hidden = step.hidden
                    for span_session in replacement:
                        sent = replace(step, hidden=hidden)
                        hidden = await span_session.send(sent)
                        span_session.history.append(sent)
                        span_session.tokens += sent.hidden.shape[1]
                logger.info("Rebuilt blocks %d:%d from %d steps", lost.span.start, lost.span.end, len(lost.history))
                return replacement
            except RemoteCallError as e:
                await _close_all(replacement)
                failed = next((s.span for s in replacement if s.span.peer_id == e.peer_id), lost.span)
                retry.failed(failed, e)
            except BaseException:
                await _close_all(replacement)
                raise

    async def aclose(self) -> None:
        self.closed = True
        spans, self._spans = self._spans, []
        await _close_all(spans)

    def close(self) -> None:
        """End the session: the servers free its caches. Further use raises SessionClosedError."""
        if self._active is not None and self in self._active:
            self._active.remove(self)
        if not self.closed:
            self.closed = True
            if self._spans:
                self.loop.run(self.aclose())

    def __enter__(self) -> InferenceSession:
        self._check_open()
        if self._active is not None:
            self._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tokens(inputs: SpanTensors, begin: int, end: int, past: int) -> SpanTensors:
    """The sub-step of tokens [begin, end) of a step that starts after `past` tokens (hypo_ids go with the first)."""
    mask, positions = inputs.attention_mask, inputs.position_ids
    return replace(
        inputs,
        hidden=inputs.hidden[:, begin:end],
        attention_mask=None if mask is None else mask[:, : past + end],
        position_ids=None if positions is None else positions[:, begin:end],
        hypo_ids=inputs.hypo_ids if begin == 0 else None,
    )


async def _close_all(spans: list[_SpanSession]) -> None:
    for span_session in spans:
        await span_session.close()
