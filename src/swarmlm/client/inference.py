"""Client inference sessions: server-side KV caches along a route; all-or-nothing steps, rollback and failover."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import replace

import torch

from swarmlm.client import trace
from swarmlm.client.chain import RetryBudget
from swarmlm.client.loop import LoopThread
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.span_call import Expected, SpanStream, fetch_info
from swarmlm.client.verify import Opinion, settle
from swarmlm.errors import BadRequestError, MissingBlocksError, RemoteCallError, SessionClosedError
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.protocol.lora import LoraWeights
from swarmlm.protocol.messages import InferenceOpen, InferenceStep, PushHop
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


def merge_history(history: list[SpanTensors], max_tokens: int) -> list[SpanTensors]:
    """The same history in fewer steps, for a replay: consecutive steps are joined into one (hidden states and
    positions concatenated, the later step's mask covering both) unless the later one reorders the cache (hypo_ids)
    or either is empty, they differ in what they carry, or the joined step would exceed max_tokens tokens."""
    merged: list[SpanTensors] = []
    for step in history:
        last = merged[-1] if merged else None
        if last is None or not _joinable(last, step, max_tokens):
            merged.append(step)
            continue
        positions = None
        if last.position_ids is not None and step.position_ids is not None:
            positions = torch.cat([last.position_ids, step.position_ids], dim=1)
        hidden = torch.cat([last.hidden, step.hidden], dim=1)
        merged[-1] = replace(last, hidden=hidden, attention_mask=step.attention_mask, position_ids=positions)
    return merged


def _joinable(first: SpanTensors, then: SpanTensors, max_tokens: int) -> bool:
    batch, seq = first.hidden.shape[0], first.hidden.shape[1] + then.hidden.shape[1]
    return (
        then.hypo_ids is None and first.hidden.shape[1] > 0 and then.hidden.shape[1] > 0 and batch * seq <= max_tokens
        and first.prompts is then.prompts
        and (first.attention_mask is None) == (then.attention_mask is None)
        and (first.position_ids is None) == (then.position_ids is None)
    )  # fmt: skip


class _SpanSession:
    """One server's part of a session: its stream, the steps its cache holds (to rebuild it elsewhere), and what
    the server holds beyond them after a failed or rolled-back step."""

    def __init__(self, manager: SequenceManager, span: RouteSpan, session_start: int):
        self.span, self.session_start = span, session_start
        self.stream = SpanStream(manager, span.peer_id, "rpc_inference")
        self.session_id = secrets.token_hex(16)  # addresses steps other servers push to this server's session
        self.history: list[SpanTensors] = []  # committed steps as this span received them (session-wide prompts)
        self.tokens = 0  # tokens the server's cache holds (more than the session's position after a failed step)
        self.pending: SpanTensors | None = None  # a step this server ran that the session has not committed
        self.broken = False  # the stream failed: the server's cache is lost to us
        self.lora_sent: LoraWeights | None = None  # the session's LoRA weights, once this server has them

    @property
    def lost(self) -> bool:
        """The server's cache is lost to us, or its stream is out of step (an interrupted step's reply may still
        come): either way the span must be rebuilt before it runs another step."""
        return self.broken or self.stream.out_of_step

    async def open(self, batch_size: int, max_length: int) -> None:
        header = InferenceOpen(
            start_block=self.span.start, end_block=self.span.end, batch_size=batch_size, max_length=max_length,
            session_id=self.session_id, adapter=self.stream.manager.config.active_adapter,
        )  # fmt: skip
        await self.stream.exchange(header, [])

    async def send(
        self, inputs: SpanTensors, start_from: int | None = None, next_hops: list[PushHop] | None = None,
        lora: LoraWeights | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Run one step (inputs.prompts: the whole session's; this span gets its blocks' rows) and return its output
        hidden states; start_from first cuts the server's cache back to that many tokens; with next_hops the server
        also pushes its output on to them (see server/push.py). lora: the session's LoRA weights, sent with the
        first step that has them (the server keeps them for the session's later steps)."""
        sent = inputs
        if inputs.prompts is not None:
            offset = self.span.start - self.session_start
            sent = replace(inputs, prompts=inputs.prompts[offset : offset + self.span.end - self.span.start])
        spec = None
        if lora is not None and lora is not self.lora_sent:
            mine = lora.blocks(self.span.start, self.span.end)
            sent, spec = replace(sent, lora=mine.flat), mine.spec
        header = InferenceStep(
            tensors=sent.names(), start_from_position=start_from, next_hops=next_hops or [], lora=spec
        )
        reply = await self.stream.exchange(header, sent.tensors())  # checked: the hidden states, shaped like ours
        self.lora_sent = lora or self.lora_sent
        return reply.required("hidden")

    async def receive(self, like: torch.Tensor, upstream: str) -> torch.Tensor:
        """The output of a step server `upstream` pushed here (shaped like the step's hidden states)."""
        reply = await self.stream.receive({"hidden": Expected.like(like)}, upstream)
        return reply.required("hidden")

    @property
    def push_error(self) -> str | None:
        """Why the last step was not pushed on (None: it was, or it had no next hop)."""
        reply = self.stream.last_reply
        return None if reply is None else reply.push_error

    async def close(self) -> None:
        await self.stream.close()


class _PushFailed(Exception):  # noqa: N818 - a signal inside this module: the step goes the client-relayed way
    """A server could not push a step on; its message says why."""


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
        active: list[InferenceSession] | None = None, on_trace: Callable[[trace.RequestTrace], None] | None = None,
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
        self._push = manager.config.use_push  # off for the rest of the session after a push fails
        self._active = active  # the owner's sessions open in `with` blocks (generate() uses the innermost)
        self.last_trace: trace.RequestTrace | None = None  # of the last step
        self._on_trace = on_trace  # also told of each step's trace (the model's last_trace)
        # LoRA weights every server of the session applies (sent once to each, again to replacements on failover)
        self._lora: LoraWeights | None = None

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
        lora: LoraWeights | None = None,
    ) -> torch.Tensor:
        """Hidden states (batch, new tokens, hidden) after the session's blocks for the new tokens' inputs.

        prompts: deep prompts of the session's blocks, (blocks, prefix, hidden) or (blocks, batch, prefix, hidden);
        hypo_ids (batch,): cache rows to continue from (beam search); attention_mask (batch, position + new tokens);
        position_ids (batch, new tokens). lora: LoRA weights (of at least the session's blocks) that this step and
        all later ones run with, until a step gives others; each server receives them once (a replay on failover
        sends them again), and such steps always run alone on the servers, never pushed or batched.
        """
        if hidden.ndim != 3:
            raise ValueError(f"hidden states must be (batch, seq, hidden), got {tuple(hidden.shape)}")
        blocks = self.end - self.start
        if prompts is not None and (prompts.ndim not in (3, 4) or prompts.shape[0] != blocks):
            raise ValueError(f"prompts must be ({blocks}, prefix, hidden) or ({blocks}, batch, prefix, hidden)")
        if lora is not None:
            self._lora = lora.with_flat(lora.flat.detach().cpu()).blocks(self.start, self.end)
        inputs = SpanTensors(
            hidden.detach().cpu(), attention_mask=attention_mask, position_ids=position_ids, hypo_ids=hypo_ids,
            prompts=None if prompts is None else prompts.detach().cpu(),
        )  # fmt: skip
        return self.loop.run(trace.traced("inference", self.astep(inputs), self._keep_trace)).to(hidden.device)

    def _keep_trace(self, finished: trace.RequestTrace) -> None:
        self.last_trace = finished
        if self._on_trace is not None:
            self._on_trace(finished)

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
        behind = any(s.tokens != self._position or s.pending is not None or s.lost for s in self._spans)
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

    def _can_push(self, inputs: SpanTensors) -> bool:
        spans = self._spans
        return (
            self._push
            and len(spans) > 1
            and inputs.hidden.shape[1] > 0
            and inputs.hypo_ids is None
            and inputs.prompts is None
            and self._lora is None
            and not any(s.lost or s.pending is not None for s in spans)
            and all(a.span.end == b.span.start for a, b in zip(spans, spans[1:], strict=False))
            and spans[0].span.start == self.start
            and spans[-1].span.end == self.end
        )

    async def _run_pushed(self, inputs: SpanTensors, retry: RetryBudget) -> list[torch.Tensor]:
        """The step sent to the first server only, each server pushing its output to the next; the client reads
        every server's output from its own stream (each span's input, kept for replays; all are returned, for the
        spot checks). On any failure the spans
        that did not answer are closed (a step may still be travelling towards them) and _PushFailed is raised:
        the caller repairs them and runs the step the client-relayed way."""
        spans, position = self._spans, self._position
        hops = [PushHop(peer_id=s.span.peer_id, session_id=s.session_id, start_from_position=position)
                for s in spans[1:]]  # fmt: skip
        hidden, index, outputs = inputs.hidden, 0, []
        try:
            for index, span_session in enumerate(spans):
                sent = replace(inputs, hidden=hidden)
                if index == 0:
                    start_from = None if span_session.tokens == position else position
                    out = await span_session.send(sent, start_from, next_hops=hops)
                else:
                    out = await span_session.receive(hidden, spans[index - 1].span.peer_id)
                span_session.pending, span_session.tokens = sent, position + hidden.shape[1]
                hidden = out
                outputs.append(out)
                if index < len(spans) - 1 and span_session.push_error:
                    raise _PushFailed(f"server {span_session.span.peer_id[-6:]} could not push: "
                                      f"{span_session.push_error}")  # fmt: skip
        except BadRequestError:
            raise  # that server refused the step and pushed nothing on; spans before it are cut back next step
        except (RemoteCallError, _PushFailed) as e:
            # first close what may still receive the step; then count the failure (which may end the request)
            if isinstance(e, RemoteCallError) and index > 0 and e.peer_id == spans[index - 1].span.peer_id:
                index -= 1  # the server that should have pushed went silent: its cache is lost to us as well
                await self._drop_after(index)
            else:
                await self._drop_after(index if spans[index].pending is None else index + 1)
            if isinstance(e, RemoteCallError):
                retry.failed(spans[index].span, e)
            elif index + 1 < len(spans):
                await self._blame_if_gone(spans[index + 1], retry)
            raise _PushFailed(str(e)) from e
        return outputs

    async def _blame_if_gone(self, span_session: _SpanSession, retry: RetryBudget) -> None:
        """A server could not push to this one: the client asks it itself, and counts it failed only if it does not
        answer (one server's word never makes a client avoid another)."""
        peer_id = span_session.span.peer_id
        try:
            await asyncio.wait_for(fetch_info(self.manager, peer_id), max(self.manager.config.ping_timeout_s, 1.0))
        except TimeoutError:
            retry.failed(span_session.span, RemoteCallError("no answer after a failed push to it", peer_id))
        except RemoteCallError as e:
            retry.failed(span_session.span, e)

    async def _drop_after(self, index: int) -> None:
        """Close the streams of spans[index:] (they are rebuilt by the next step's repair)."""
        for span_session in self._spans[index:]:
            if not span_session.broken:
                span_session.broken = True
                await span_session.close()

    async def _run_spans(self, inputs: SpanTensors, retry: RetryBudget) -> torch.Tensor:
        """The step through every span, re-opening failed ones; each span keeps what it ran as pending."""
        hidden, index, covered = inputs.hidden, 0, self.start
        if self._can_push(inputs):
            try:
                outputs = await self._run_pushed(inputs, retry)
            except _PushFailed as e:
                logger.warning("Push failed (%s); this session's steps now go through the client", e)
                self._push = False
                await self._repair(retry)
            else:
                while index < len(outputs):
                    span_session = self._spans[index]
                    if span_session.pending is None:
                        raise RuntimeError("a pushed step left a span without its step")
                    checked = await self._check(span_session, span_session.pending, outputs[index])
                    if checked is not None:
                        # the spans after it ran on a wrong input: the loop below cuts them back and runs them again
                        hidden, winners = checked
                        self._spans[index : index + 1] = winners
                        index, covered = index + len(winners), winners[-1].span.end
                        break
                    index += 1
                else:
                    return outputs[-1]
        while index < len(self._spans):
            span_session = self._spans[index]
            sent = replace(inputs, hidden=hidden)
            start_from = None if span_session.tokens == self._position else self._position
            try:
                out = await span_session.send(sent, start_from, lora=self._lora)
            except BadRequestError:
                raise  # the server kept its cache as it was; spans before this one are cut back at the next step
            except RemoteCallError as e:
                span_session.broken = True
                await span_session.close()
                retry.failed(span_session.span, e)
                trace.record_replay()
                self._spans[index : index + 1] = await self._rebuild(span_session, retry)
                continue
            span_session.pending, span_session.tokens = sent, self._position + hidden.shape[1]
            if span_session.span.start != covered:
                raise RuntimeError(f"inference route skipped blocks {covered}:{span_session.span.start}")
            checked = await self._check(span_session, sent, out)
            if checked is not None:  # the span's result lost a spot check: the checking sessions take its place
                out, winners = checked
                self._spans[index : index + 1] = winners
                index += len(winners) - 1
            hidden, index, covered = out, index + 1, self._spans[index].span.end
        if covered != self.end:  # never return hidden states that missed a block
            raise RuntimeError(f"inference step ran blocks {self.start}:{covered} of {self.start}:{self.end}")
        return hidden

    async def _check(
        self, checked: _SpanSession, sent: SpanTensors, out: torch.Tensor
    ) -> tuple[torch.Tensor, list[_SpanSession]] | None:
        """Spot-check a span's step when the Verifier asks for it: independent servers replay the span's history (as
        failover does) and run the step. None keeps the span; else the winning output and sessions (which then
        hold the history and the step as pending, like the span they replace)."""
        manager, span = self.manager, checked.span
        first = Opinion((span.peer_id,), (manager.dtype_of(span.peer_id),), out, manager.config.wire_dtype)
        reason = manager.verifier.reason_to_check(first.peers, span.end, out)
        if reason is None or self.batch_size is None:
            return None
        replicas: dict[tuple[str, ...], list[_SpanSession]] = {}

        async def rerun(avoid: set[str]) -> Opinion | None:
            if not manager.can_route(span.start, span.end, self.batch_size or 1, avoid):
                return None
            retry = RetryBudget(manager, spread=False)  # few servers: each one used here cannot settle a disagreement
            retry.avoid |= avoid
            chain: list[_SpanSession] = []
            try:
                with trace.purpose("check"):
                    chain = await self._rebuild(checked, retry)
                    hidden = sent.hidden
                    for span_session in chain:
                        step = replace(sent, hidden=hidden)
                        hidden = await span_session.send(step, lora=self._lora)
                        span_session.pending, span_session.tokens = step, span_session.tokens + hidden.shape[1]
            except (RemoteCallError, MissingBlocksError) as e:
                await _close_all(chain)
                logger.info("A check of blocks %d:%d found no working independent route: %s", span.start, span.end, e)
                return None
            peers = tuple(s.span.peer_id for s in chain)
            replicas[peers] = chain
            return Opinion(peers, tuple(manager.dtype_of(peer) for peer in peers), hidden, manager.config.wire_dtype)

        def convict(peers: tuple[str, ...], why: str) -> None:
            manager.convict(peers, why, span.start, span.end)

        winner = first
        try:
            winner = await settle(manager.verifier, first, rerun, convict, span.start, span.end, reason)
        finally:
            for peers, chain in replicas.items():
                if peers != winner.peers:
                    await _close_all(chain)
        if winner is first:
            return None
        checked.broken = True
        await checked.close()
        return winner.output, replicas[winner.peers]

    async def _repair(self, retry: RetryBudget) -> None:
        """Bring every span to the session's position after a failed step: a span that ran it without reordering
        its cache is cut back by its next step; one that reordered it, or whose server was lost, is rebuilt."""
        repaired: list[_SpanSession] = []
        for index, span_session in enumerate(self._spans):
            if span_session.pending is not None and span_session.pending.hypo_ids is None:
                span_session.pending = None
            if span_session.pending is None and not span_session.lost:
                repaired.append(span_session)
                continue
            if not span_session.broken:
                span_session.broken = True
                await span_session.close()
            try:
                trace.record_replay()
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
                    opened.append(span_session)  # closed below by any failure, an interrupted open's included
                    try:
                        await span_session.open(batch, self.max_length)
                    except RemoteCallError as e:
                        opened.pop()
                        await span_session.close()
                        retry.failed(span, e)
                        break
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
                # one step per run of steps: a replay costs a few round trips, not one per token generated
                for step in merge_history(lost.history, self.manager.request_limit(lost.span.start, lost.span.end)):
                    hidden = step.hidden
                    for span_session in replacement:
                        sent = replace(step, hidden=hidden)
                        hidden = await span_session.send(sent, lora=self._lora)
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
