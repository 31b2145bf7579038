"""The chain runner: hidden states through a route of spans and gradients back, re-routing around failed servers."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.span_call import call_span
from swarmlm.errors import BadRequestError, RemoteCallError
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.protocol.messages import BackwardRequest, ForwardRequest
from swarmlm.swarm.routing import RouteSpan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hop:
    span: RouteSpan  # the blocks and server that ran them
    inputs: torch.Tensor  # the hidden states the span received


@dataclass(frozen=True)
class ChainArgs:
    """One (sub-)batch's bundle for a chain: at each hop its hidden states are the previous hop's output, its deep
    prompts are cut to the hop's blocks, and the rest (mask, positions) travels unchanged."""

    inputs: SpanTensors  # the chain's input: hidden (batch, seq, hidden) and what travels with it
    prompts_start: int = 0  # inputs.prompts[i] is for block prompts_start + i

    def for_span(self, span: RouteSpan, hidden: torch.Tensor, grad: torch.Tensor | None = None) -> SpanTensors:
        prompts = self.inputs.prompts
        if prompts is not None:
            prompts = prompts[span.start - self.prompts_start : span.end - self.prompts_start]
        return replace(self.inputs, hidden=hidden, grad_outputs=grad, prompts=prompts)


class RetryBudget:
    """The one retry policy: bad requests fail at once; server failures ban the server, then route around it."""

    def __init__(self, manager: SequenceManager):
        self.manager, self.failures = manager, 0

    def failed(self, span: RouteSpan, error: RemoteCallError) -> None:
        if isinstance(error, BadRequestError):
            raise error
        self.failures += 1
        self.manager.ban(span.peer_id, error)
        if self.failures > self.manager.config.max_retries:
            raise RemoteCallError(f"giving up after {self.failures} failed calls; last: {error}") from error
        logger.info("Re-routing blocks %d:%d after failure %d", span.start, span.end, self.failures)


async def _call(
    manager: SequenceManager, span: RouteSpan, hidden: torch.Tensor, args: ChainArgs, grad: torch.Tensor | None
) -> list[torch.Tensor]:
    """The span-call helper of both directions: forward when grad is None, else backward."""
    bundle = args.for_span(span, hidden, grad)
    request_type = ForwardRequest if grad is None else BackwardRequest
    header = request_type(start_block=span.start, end_block=span.end, tensors=bundle.names())
    _, outputs = await call_span(manager, span.peer_id, f"rpc_{header.kind}", header, bundle.tensors())
    expected = [hidden.shape] + ([bundle.prompts.shape] if grad is not None and bundle.prompts is not None else [])
    if [o.shape for o in outputs] != expected:
        raise RemoteCallError(f"{header.kind} reply has shapes {[tuple(o.shape) for o in outputs]}", span.peer_id)
    return outputs


async def run_forward_chain(
    manager: SequenceManager, hidden: torch.Tensor, start: int, end: int, args: ChainArgs
) -> tuple[torch.Tensor, list[Hop]]:
    """Hidden states after blocks [start, end) from `hidden` (args.inputs.hidden, or a hop's saved input when a
    backward recomputes a span), and the hops that produced them (with each hop's inputs)."""
    retry, hops, position = RetryBudget(manager), [], start
    tokens = hidden.shape[0] * hidden.shape[1]
    while position < end:
        route = await manager.make_route(position, end, tokens)
        for span in route:
            try:
                (out,) = await _call(manager, span, hidden, args, grad=None)
            except RemoteCallError as e:
                retry.failed(span, e)
                break  # re-route from the failed block on
            hops.append(Hop(span, hidden))
            hidden, position = out, span.end
    return hidden, hops


async def run_backward_chain(
    manager: SequenceManager, hops: list[Hop], grad: torch.Tensor, args: ChainArgs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients wrt the chain's input and its prompts, walking the hops in reverse.

    When a hop's server fails, the forward of exactly that block range is re-run from the hop's saved input on a
    new route, and the backward continues through the replacement hops: the gradients do not change.
    """
    retry, pending = RetryBudget(manager), list(hops)
    grad_prompts = None if args.inputs.prompts is None else torch.zeros_like(args.inputs.prompts)
    while pending:
        hop = pending.pop()
        try:
            grads = await _call(manager, hop.span, hop.inputs, args, grad=grad)
        except RemoteCallError as e:
            retry.failed(hop.span, e)
            _, replacement = await run_forward_chain(manager, hop.inputs, hop.span.start, hop.span.end, args)
            pending.extend(replacement)
            continue
        grad = grads[0]
        if grad_prompts is not None:
            begin = hop.span.start - args.prompts_start
            grad_prompts[begin : begin + hop.span.end - hop.span.start] += grads[1]
    return grad, grad_prompts
