"""The chain runner: hidden states through a route of spans and gradients back, re-routing around failed servers."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, replace

import torch

from swarmlm.client import trace
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.span_call import Expected, Expects, RerouteError, call_span
from swarmlm.client.verify import Opinion, settle
from swarmlm.errors import BadRequestError, MissingBlocksError, RemoteCallError, SwarmBusyError, UnreachableError
from swarmlm.protocol.bundle import ReplyTensors, SpanTensors
from swarmlm.protocol.lora import LoraWeights
from swarmlm.protocol.messages import BackwardRequest, ForwardRequest
from swarmlm.swarm.routing import RouteSpan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hop:
    span: RouteSpan  # the blocks and server that ran them
    inputs: torch.Tensor  # the hidden states the span received
    kept: str | None = None  # the id under which the server was asked to keep the forward's graph for the backward


@dataclass(frozen=True)
class ChainArgs:
    """One (sub-)batch's bundle for a chain: at each hop its hidden states are the previous hop's output, its deep
    prompts and LoRA weights are cut to the hop's blocks, and the rest (mask, positions) travels unchanged."""

    inputs: SpanTensors  # the chain's input: hidden (batch, seq, hidden) and what travels with it
    prompts_start: int = 0  # inputs.prompts[i] is for block prompts_start + i
    lora: LoraWeights | None = None  # the client's own LoRA weights of (at least) the chain's blocks

    def for_span(self, span: RouteSpan, hidden: torch.Tensor, grad: torch.Tensor | None = None) -> SpanTensors:
        prompts = self.inputs.prompts
        if prompts is not None:
            prompts = prompts[span.start - self.prompts_start : span.end - self.prompts_start]
        lora = None if self.lora is None else self.lora.blocks(span.start, span.end).flat
        return replace(self.inputs, hidden=hidden, grad_outputs=grad, prompts=prompts, lora=lora)


class RetryBudget:
    """The one retry policy of a request (forward, backward or an inference step), bounded by max_retries calls.

    - "busy": the server has no room now. It cools down on this client for the wait it suggested, bounded (no
      failure of it, never escalating) and the request goes elsewhere, or back to it once the cool-down is over;
      when only busy servers are left, SwarmBusyError says the swarm is full (after busy_wait_s, or max_retries).
      "timeout" (the request stopped arriving at the server: the path between them stalled, not necessarily the
      server) is treated the same.
    - "too_large": the request exceeds this server's own limits: it is avoided for the rest of this request. If no
      other server can run the span, the RerouteError is raised (RemoteSequential then splits the sub-batch).
    - "not_served": the server does not hold the blocks or adapter it was asked for (it moved, or restarted with
      another span, since this client read its announcement): it is avoided for the rest of this request, the swarm
      is read again before the next route, and the route waits for missing blocks like any other.
    - "bad_request" from one server: maybe that server is wrong, so another server is asked. The request is the
      user's error (BadRequestError) only once two different servers refused it, or when no other server can run
      the span (then that server's message is raised).
    - "unreachable" (the server could not be connected to at the addresses it announced): it is banned with
      exponential backoff and avoided for the rest of this request, without counting as a failure: announcements are
      strangers' claims, and any number of fake ones must cost a request one short dial each, not its retries.
    - anything else (server errors, transport errors, timeouts, malformed or non-finite replies): the server is banned
      with exponential backoff and the request is re-routed.
    """

    def __init__(self, manager: SequenceManager, spread: bool = True):
        self.manager, self.failures, self.spread = manager, 0, spread  # spread: see SequenceManager.make_route
        self.avoid: set[str] = set()  # servers this request does not go to again
        self._refused_by: set[str] = set()  # servers that called this request bad
        self._stale_view = False  # a server refused what it was announced to hold: re-read the swarm first
        # the first busy answer of this request: busy_wait_s counts from it over all the routes tried since (counted
        # per route, each cool-down would start the wait again and a full swarm would answer after max_retries)
        self.busy_since: float | None = None

    async def route(self, start: int, end: int, tokens: int, session_tokens: int | None = None) -> list[RouteSpan]:
        """A route over [start, end) for `tokens` tokens, without the servers this request avoids (and for opening
        inference sessions of session_tokens tokens, avoiding servers that announce too little free cache)."""
        config = self.manager.config
        try:
            # make_route gives up after missing_blocks_timeout_s; this deadline also bounds its DHT reads
            async with asyncio.timeout(config.missing_blocks_timeout_s + config.request_timeout_s):
                if self._stale_view:
                    self._stale_view = False
                    await self.manager.refresh()
                return await self.manager.make_route(start, end, tokens, self.avoid, session_tokens, self.spread,
                                                     busy_since=self.busy_since)  # fmt: skip
        except TimeoutError as e:
            raise RemoteCallError(f"finding a route over blocks {start}:{end} timed out") from e

    def failed(self, span: RouteSpan, error: RemoteCallError, tokens: int = 1) -> None:
        """Account for a failed call of `span` and raise when the request cannot go on."""
        trace.record_retry()
        peer = span.peer_id
        if isinstance(error, UnreachableError):
            self.avoid.add(peer)  # never again in this request: so this happens at most once per server
            self.manager.unreachable(peer, error)
            return
        self.failures += 1
        if isinstance(error, BadRequestError):
            self._refused_by.add(peer)
            self.avoid.add(peer)
            if len(self._refused_by) >= 2 or not self.manager.can_route(span.start, span.end, tokens, self.avoid):
                raise error
        elif isinstance(error, RerouteError) and error.kind == "not_served":
            self.avoid.add(peer)
            self._stale_view = True
        elif isinstance(error, RerouteError) and error.kind == "too_large":
            self.avoid.add(peer)
            if not self.manager.can_route(span.start, span.end, tokens, self.avoid):
                raise error
        elif isinstance(error, RerouteError):
            self.manager.cool_down(peer, error, error.retry_after_s)
            if error.kind == "busy" and self.busy_since is None:
                self.busy_since = time.monotonic()
        else:
            self.manager.ban(peer, error)
        if self.failures > self.manager.config.max_retries:
            if isinstance(error, RerouteError) and error.kind == "busy":  # the swarm is full: say so, and when
                waited_s = time.monotonic() - (self.busy_since or time.monotonic())
                raise SwarmBusyError(span.start, span.end, waited_s, self.manager.health.cooling_left_s()) from error
            raise RemoteCallError(f"giving up after {self.failures} failed calls; last: {error}") from error
        logger.info("Re-routing blocks %d:%d after failure %d: %s", span.start, span.end, self.failures, error)


async def _call(
    manager: SequenceManager, span: RouteSpan, hidden: torch.Tensor, args: ChainArgs, grad: torch.Tensor | None,
    kept: str | None = None,
) -> ReplyTensors:  # fmt: skip
    """The span-call helper of both directions: forward when grad is None, else backward. kept: in a forward, the
    id under which the server is asked to keep the graph; in a backward, the id its forward was kept under."""
    bundle = args.for_span(span, hidden, grad)
    spec = None if args.lora is None else args.lora.spec
    adapter = manager.config.active_adapter
    header: ForwardRequest = (
        ForwardRequest(start_block=span.start, end_block=span.end, tensors=bundle.names(), adapter=adapter,
                       lora=spec, keep=kept) if grad is None
        else BackwardRequest(start_block=span.start, end_block=span.end, tensors=bundle.names(), adapter=adapter,
                             lora=spec, kept=kept)
    )  # fmt: skip
    # the reply: hidden states like the input; in backward their gradient, and the prompts' and LoRA gradients
    # exactly when the request sent prompts and LoRA weights
    expected: Expects = {"hidden": Expected.like(hidden)}
    if grad is not None:
        expected = {"grad_hidden": Expected.like(hidden)}
        if bundle.prompts is not None:
            expected["grad_prompts"] = Expected.like(bundle.prompts)
        if bundle.lora is not None:
            expected["grad_lora"] = Expected.like(bundle.lora)
    _, reply = await call_span(manager, span.peer_id, f"rpc_{header.kind}", header, bundle.tensors(), expected)
    return reply


async def run_forward_chain(
    manager: SequenceManager,
    hidden: torch.Tensor,
    start: int,
    end: int,
    args: ChainArgs,
    retry: RetryBudget | None = None,
    verify: bool = True,
    keep: bool = False,
) -> tuple[torch.Tensor, list[Hop]]:
    """Hidden states after blocks [start, end) from `hidden` (args.inputs.hidden, or a hop's saved input when a
    backward recomputes a span, under the backward's retry budget), and the hops that produced them (with each
    hop's inputs). With verify, hops are spot-checked as the client's Verifier decides (client/verify.py). With
    keep, each server is asked to keep its hop's graph for the backward (server/activations.py)."""
    retry, hops, position = retry or RetryBudget(manager), [], start
    tokens = hidden.shape[0] * hidden.shape[1]
    while position < end:
        route = await retry.route(position, end, tokens)
        for span in route:
            kept = secrets.token_hex(16) if keep else None
            try:
                out = (await _call(manager, span, hidden, args, grad=None, kept=kept)).required("hidden")
            except RemoteCallError as e:
                retry.failed(span, e, tokens)
                break  # re-route from the failed block on
            checked = await check_hop(manager, span, hidden, out, args) if verify else None
            if checked is None:
                hops.append(Hop(span, hidden, kept))
            else:  # the hop's result lost a spot check: go on with (and later backpropagate through) the winners
                out, winners = checked
                hops.extend(winners)
            hidden, position = out, span.end
    return hidden, hops


async def check_hop(
    manager: SequenceManager, span: RouteSpan, hidden: torch.Tensor, out: torch.Tensor, args: ChainArgs
) -> tuple[torch.Tensor, list[Hop]] | None:
    """Spot-check a forward hop when the Verifier asks for it: None keeps the hop's result, else the result that
    won the check and the hops of the independent route that produced it (see verify.settle)."""
    first = Opinion((span.peer_id,), (manager.dtype_of(span.peer_id),), out, manager.config.wire_dtype)
    reason = manager.verifier.reason_to_check(first.peers, span.end, out)
    if reason is None:
        return None
    tokens = hidden.shape[0] * hidden.shape[1]
    routes: dict[tuple[str, ...], list[Hop]] = {}

    async def rerun(avoid: set[str]) -> Opinion | None:
        if not manager.can_route(span.start, span.end, tokens, avoid):
            return None
        retry = RetryBudget(manager, spread=False)  # few servers: each one used here cannot settle a disagreement
        retry.avoid |= avoid
        try:
            with trace.purpose("check"):
                result, hops = await run_forward_chain(manager, hidden, span.start, span.end, args, retry, False)
        except (RemoteCallError, MissingBlocksError) as e:
            logger.info("A check of blocks %d:%d found no working independent route: %s", span.start, span.end, e)
            return None
        peers = tuple(hop.span.peer_id for hop in hops)
        routes[peers] = hops
        return Opinion(peers, tuple(manager.dtype_of(peer) for peer in peers), result, manager.config.wire_dtype)

    def convict(peers: tuple[str, ...], why: str) -> None:
        manager.convict(peers, why, span.start, span.end)

    winner = await settle(manager.verifier, first, rerun, convict, span.start, span.end, reason)
    return None if winner is first else (winner.output, routes[winner.peers])


async def run_backward_chain(
    manager: SequenceManager, hops: list[Hop], grad: torch.Tensor, args: ChainArgs
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients wrt the chain's input, its prompts and its LoRA weights (args.lora.flat), walking the hops in
    reverse.

    When a hop's server fails, the forward of exactly that block range is re-run from the hop's saved input on a
    new route, and the backward continues through the replacement hops: the gradients do not change. A hop whose
    server kept its forward's graph runs its backward from it (the server recomputes the forward when it did not).
    """
    retry, pending = RetryBudget(manager), list(hops)
    grad_prompts = None if args.inputs.prompts is None else torch.zeros_like(args.inputs.prompts)
    grad_lora = None if args.lora is None else torch.zeros_like(args.lora.flat)
    while pending:
        hop = pending.pop()
        try:
            grads = await _call(manager, hop.span, hop.inputs, args, grad=grad, kept=hop.kept)
        except RemoteCallError as e:
            retry.failed(hop.span, e, hop.inputs.shape[0] * hop.inputs.shape[1])
            _, replacement = await run_forward_chain(
                manager, hop.inputs, hop.span.start, hop.span.end, args, retry, verify=False, keep=True
            )  # only its hops are used: their outputs are not checked
            pending.extend(replacement)
            continue
        grad = grads.required("grad_hidden")
        if grad_prompts is not None:
            begin = hop.span.start - args.prompts_start
            grad_prompts[begin : begin + hop.span.end - hop.span.start] += grads.required("grad_prompts")
        if grad_lora is not None and args.lora is not None:
            bounds, first = args.lora.layout.bounds, args.lora.first
            grad_lora[bounds[hop.span.start - first] : bounds[hop.span.end - first]] += grads.required("grad_lora")
    return grad, grad_prompts, grad_lora
