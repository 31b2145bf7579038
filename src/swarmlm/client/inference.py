"""Client inference sessions: server-side KV caches along a route; all-or-nothing steps, rollback and failover.

The session's data (its route, position, what each span's cache holds) is in client/session_state.py, its links to
the servers in client/session_links.py, what it plans when they fail in client/session_plan.py and how those plans
are carried out in client/session_recovery.py. This module holds the public session and its one step function, which
reads top to bottom whatever path a step takes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from swarmlm.client import trace
from swarmlm.client.chain import RetryBudget
from swarmlm.client.loop import LoopThread
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.session_links import SpanLink, close_all
from swarmlm.client.session_plan import plan_rebuild
from swarmlm.client.session_recovery import Recovery
from swarmlm.client.session_state import SessionState, pushable, split_step
from swarmlm.client.verify import Opinion, settle
from swarmlm.errors import BadRequestError, MissingBlocksError, RemoteCallError, SessionClosedError
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.protocol.lora import LoraWeights
from swarmlm.swarm.routing import RouteSpan

logger = logging.getLogger(__name__)


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
        self.manager, self.loop = manager, loop
        # the session's data, its route included: the links to the servers holding the caches, in block order
        self.state: SessionState[SpanLink] = SessionState(start, end, max_length, push=manager.config.use_push)
        self.closed = False
        self._recovery = Recovery(manager, self.state)
        self._active = active  # the owner's sessions open in `with` blocks (generate() uses the innermost)
        self.last_trace: trace.RequestTrace | None = None  # of the last step
        # every step of the generate() call under way, so that the model's last_trace after it tells the whole
        # generation (a failover at its third step is not forgotten by its tenth)
        self.generation_trace: trace.RequestTrace | None = None
        self._on_trace = on_trace  # also told of each step's trace (the model's last_trace)

    @property
    def start(self) -> int:
        return self.state.start

    @property
    def end(self) -> int:
        return self.state.end

    @property
    def max_length(self) -> int:
        return self.state.max_length

    @property
    def batch_size(self) -> int | None:
        """Rows of every step (None until the first step opens the route)."""
        return self.state.batch_size

    @property
    def route(self) -> list[RouteSpan]:
        """The servers holding this session's caches now, in block order (empty before the first step)."""
        return [link.span for link in self.state.route]

    @property
    def position(self) -> int:
        """Tokens the session holds (processed by every block)."""
        return self.state.position

    @position.setter
    def position(self, tokens: int) -> None:
        """Roll back to `tokens` tokens: the servers cut their caches at the next step."""
        self._check_open()
        self.state.rollback(tokens)
        self._rolled_back(tokens)

    def _rolled_back(self, tokens: int) -> None:
        """Told of each rollback to `tokens` tokens, for what a subclass keeps beside the caches (its token ids)."""

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
        inputs = self.inputs(
            hidden, prompts, hypo_ids, attention_mask=attention_mask, position_ids=position_ids, lora=lora
        )
        return self.loop.run(self.atraced_step(inputs)).to(hidden.device)

    def inputs(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        lora: LoraWeights | None = None,
    ) -> SpanTensors:
        """step()'s arguments, checked, as the tensors a step sends (on the CPU); LoRA weights are kept for the
        session's later steps from here on."""
        if hidden.ndim != 3:
            raise ValueError(f"hidden states must be (batch, seq, hidden), got {tuple(hidden.shape)}")
        blocks = self.end - self.start
        if prompts is not None and (prompts.ndim not in (3, 4) or prompts.shape[0] != blocks):
            raise ValueError(f"prompts must be ({blocks}, prefix, hidden) or ({blocks}, batch, prefix, hidden)")
        if lora is not None:
            self.state.lora = lora.with_flat(lora.flat.detach().cpu()).blocks(self.start, self.end)
        return SpanTensors(
            hidden.detach().cpu(), attention_mask=attention_mask, position_ids=position_ids, hypo_ids=hypo_ids,
            prompts=None if prompts is None else prompts.detach().cpu(),
        )  # fmt: skip

    async def atraced_step(self, inputs: SpanTensors) -> torch.Tensor:
        """astep() with its own request trace, kept as the session's last_trace (and the client's)."""
        return await trace.traced("inference", self.astep(inputs), self._keep_trace)

    def _keep_trace(self, finished: trace.RequestTrace) -> None:
        self.last_trace = finished
        if self.generation_trace is not None:
            self.generation_trace.add(finished)
        if self._on_trace is not None:
            self._on_trace(self.generation_trace or finished)

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError("this inference session is closed")

    async def astep(self, inputs: SpanTensors) -> torch.Tensor:
        """step() on the client's loop: inputs.hidden (batch, new tokens, hidden) with what travels with it.

        A step with more tokens than one request may carry (the client's max_tokens_per_request, and what the
        servers announce they accept) runs as consecutive sub-steps; if one fails, the session is cut back to where
        the step began, so a step still either happens whole or not at all."""
        began = self.position
        parts = split_step(inputs, self.manager.request_limit(self.start, self.end), began)
        if len(parts) == 1:
            return await self._astep_whole(inputs)
        outputs = []
        try:
            for part in parts:
                outputs.append(await self._astep_whole(part))
        except BaseException:
            if self.position != began and not self.closed:
                self.position = began  # the next step cuts the servers' caches back to here
            raise
        return torch.cat(outputs, dim=1)

    async def _astep_whole(self, inputs: SpanTensors) -> torch.Tensor:
        """One step, whatever its path: checked against the session's limits; opened, and every span brought back to
        the position (the recovery policy cuts back or rebuilds what a failed step left behind); pushed from server
        to server when it can be, its spans spot-checked; relayed by the client through the spans the push did not
        settle (all of them when it was not pushed); then recorded in every span's history and the position."""
        self._check_open()
        self.state.check_step(inputs)
        if self.state.is_noop(inputs):
            return inputs.hidden  # nothing to compute, nothing to cut: no call
        retry = RetryBudget(self.manager)
        if not self.state.route:
            await self._recovery.open_route(inputs.hidden.shape[0], retry)
        await self._recovery.repair(retry)
        done, hidden = 0, inputs.hidden
        if pushable(inputs, self.state):
            done, hidden = await self._pushed(inputs, retry)
        hidden = await self._relayed(inputs, hidden, done, retry)
        self.state.commit(inputs)
        return hidden

    async def _pushed(self, inputs: SpanTensors, retry: RetryBudget) -> tuple[int, torch.Tensor]:
        """The pushed path, then the spot checks of its spans: (spans that ran the step and passed, the last one's
        output). When the push fails, pushing stops for this session and every span is repaired: (0, the inputs).
        When a check replaces a span, the spans after it ran on a wrong input: the relayed path runs them again."""
        try:
            outputs = await self._run_pushed(inputs, retry)
        except _PushFailed as e:
            logger.warning("Push failed (%s); this session's steps now go through the client", e)
            self.state.push = False
            await self._recovery.repair(retry)
            return 0, inputs.hidden
        index = 0
        while index < len(outputs):
            link = self.state.route[index]
            if link.state.pending is None:
                raise RuntimeError("a pushed step left a span without its step")
            checked = await self._check(link, link.state.pending, outputs[index])
            if checked is not None:
                hidden, winners = checked
                self.state.splice(index, 1, winners)
                return index + len(winners), hidden
            index += 1
        return len(self.state.route), outputs[-1]

    async def _run_pushed(self, inputs: SpanTensors, retry: RetryBudget) -> list[torch.Tensor]:
        """The step sent to the first server only, each server pushing its output to the next; the client reads
        every server's output from its own stream (each span's input, kept for replays; all are returned, for the
        spot checks). On any failure the recovery policy closes the spans that did not answer (a step may still be
        travelling towards them) and _PushFailed is raised: the caller repairs them and relays the step."""
        spans, position = self.state.route, self.position
        hops = [link.hop(position) for link in spans[1:]]
        hidden, index, outputs = inputs.hidden, 0, []
        try:
            for index, link in enumerate(spans):
                sent = replace(inputs, hidden=hidden)
                if index == 0:
                    out = await link.send(sent, link.state.start_from(position), next_hops=hops)
                else:
                    out = await link.receive(hidden, spans[index - 1].span.peer_id)
                link.state.ran(sent, position)
                hidden = out
                outputs.append(out)
                if index < len(spans) - 1 and link.push_error:
                    raise _PushFailed(f"server {link.span.peer_id[-6:]} could not push: {link.push_error}")
        except BadRequestError:
            raise  # that server refused the step and pushed nothing on; spans before it are cut back next step
        except (RemoteCallError, _PushFailed) as e:
            error = e if isinstance(e, RemoteCallError) else None
            await self._recovery.after_push_failure(index, error, retry)
            raise _PushFailed(str(e)) from e
        return outputs

    async def _relayed(
        self, inputs: SpanTensors, hidden: torch.Tensor, index: int, retry: RetryBudget
    ) -> torch.Tensor:
        """The relayed path from span `index` on (its input: hidden): the client sends the step to each span in turn,
        a failed span is replaced by the recovery policy, and each span's result may be spot-checked."""
        position, route = self.position, self.state.route
        covered = self.start if index == 0 else route[index - 1].span.end
        while index < len(route):
            link = route[index]
            sent = replace(inputs, hidden=hidden)
            try:
                out = await link.send(sent, link.state.start_from(position), lora=self.state.lora)
            except BadRequestError:
                raise  # the server kept its cache as it was; spans before this one are cut back at the next step
            except RemoteCallError as e:
                await self._recovery.replace_failed(index, e, retry)
                continue
            link.state.ran(sent, position)
            if link.span.start != covered:
                raise RuntimeError(f"inference route skipped blocks {covered}:{link.span.start}")
            checked = await self._check(link, sent, out)
            if checked is not None:  # the span's result lost a spot check: the checking links take its place
                out, winners = checked
                self.state.splice(index, 1, winners)
                index += len(winners) - 1
            hidden, index, covered = out, index + 1, route[index].span.end
        if covered != self.end:  # never return hidden states that missed a block
            raise RuntimeError(f"inference step ran blocks {self.start}:{covered} of {self.start}:{self.end}")
        return hidden

    async def _check(
        self, checked: SpanLink, sent: SpanTensors, out: torch.Tensor
    ) -> tuple[torch.Tensor, list[SpanLink]] | None:
        """The checked path: spot-check a span's step when the Verifier asks for it: independent servers replay the
        span's history (as failover does) and run the step. None keeps the span; else the winning output and links
        (which then hold the history and the step as pending, like the span they replace)."""
        manager, span = self.manager, checked.span
        first = Opinion((span.peer_id,), (manager.dtype_of(span.peer_id),), out, manager.config.wire_dtype)
        reason = manager.verifier.reason_to_check(first.peers, span.end, out)
        if reason is None or self.batch_size is None:
            return None
        replicas: dict[tuple[str, ...], list[SpanLink]] = {}

        async def rerun(avoid: set[str]) -> Opinion | None:
            if not manager.can_route(span.start, span.end, self.batch_size or 1, avoid):
                return None
            retry = RetryBudget(manager, spread=False)  # few servers: each one used here cannot settle a disagreement
            retry.avoid |= avoid
            chain: list[SpanLink] = []
            try:
                with trace.purpose("check"):
                    chain = await self._recovery.rebuild(plan_rebuild(checked), retry)
                    hidden = sent.hidden
                    for link in chain:
                        step = replace(sent, hidden=hidden)
                        hidden = await link.send(step, lora=self.state.lora)
                        link.state.ran(step, link.state.tokens)
            except (RemoteCallError, MissingBlocksError) as e:
                await close_all(chain)
                logger.info("A check of blocks %d:%d found no working independent route: %s", span.start, span.end, e)
                return None
            peers = tuple(link.span.peer_id for link in chain)
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
                    await close_all(chain)
        if winner is first:
            return None
        checked.state.broken = True
        await checked.close()
        return winner.output, replicas[winner.peers]

    async def aclose(self) -> None:
        self.closed = True
        await self._recovery.close_route()

    def close(self) -> None:
        """End the session: the servers free its caches. Further use raises SessionClosedError."""
        if self._active is not None and self in self._active:
            self._active.remove(self)
        if not self.closed:
            self.closed = True
            if self.state.route:
                self.loop.run(self.aclose())

    def __enter__(self) -> InferenceSession:
        self._check_open()
        if self._active is not None:
            self._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
