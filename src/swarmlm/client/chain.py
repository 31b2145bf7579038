"""The chain runner: hidden states through a route of spans and gradients back, re-routing around failed servers."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.span_call import call_span
from swarmlm.errors import BadRequestError, RemoteCallError
from swarmlm.protocol.messages import BackwardRequest, ForwardRequest
from swarmlm.swarm.routing import RouteSpan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hop:
    span: RouteSpan  # the blocks and server that ran them
    inputs: torch.Tensor  # the hidden states the span received


@dataclass(frozen=True)
class ChainArgs:
    """What travels with the hidden states of one (sub-)batch to every span."""

    attention_mask: torch.Tensor | None = None  # (batch, seq) of 0/1
    position_ids: torch.Tensor | None = None  # (batch, seq)
    prompts: torch.Tensor | None = None  # (blocks, prefix, hidden): prompts[i] is for block prompts_start + i
    prompts_start: int = 0

    def prompts_for(self, span: RouteSpan) -> torch.Tensor | None:
        if self.prompts is None:
            return None
        return self.prompts[span.start - self.prompts_start : span.end - self.prompts_start]


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
    prompts = args.prompts_for(span)
    request_type = ForwardRequest if grad is None else BackwardRequest
    header = request_type(
        start_block=span.start,
        end_block=span.end,
        has_attention_mask=args.attention_mask is not None,
        has_position_ids=args.position_ids is not None,
        has_prompts=prompts is not None,
    )
    tensors = [t for t in (hidden, grad, args.attention_mask, args.position_ids, prompts) if t is not None]
    _, outputs = await call_span(manager, span.peer_id, f"rpc_{header.kind}", header, tensors)
    expected = [hidden.shape] + ([prompts.shape] if grad is not None and prompts is not None else [])
    if [o.shape for o in outputs] != expected:
        raise RemoteCallError(f"{header.kind} reply has shapes {[tuple(o.shape) for o in outputs]}", span.peer_id)
    return outputs


async def run_forward_chain(
    manager: SequenceManager, hidden: torch.Tensor, start: int, end: int, args: ChainArgs
) -> tuple[torch.Tensor, list[Hop]]:
    """Hidden states after blocks [start, end), and the hops that produced them (with each hop's inputs)."""
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
    grad_prompts = None if args.prompts is None else torch.zeros_like(args.prompts)
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
