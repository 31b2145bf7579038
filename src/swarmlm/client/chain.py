"""The chain runner: push hidden states through a route of spans, re-routing around servers that fail."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.span_call import call_span
from swarmlm.errors import BadRequestError, RemoteCallError
from swarmlm.protocol.messages import ForwardRequest
from swarmlm.swarm.routing import RouteSpan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hop:
    span: RouteSpan  # the blocks and server that ran them
    inputs: torch.Tensor  # the hidden states the span received


@dataclass(frozen=True)
class ForwardArgs:
    attention_mask: torch.Tensor | None = None  # (batch, seq) of 0/1
    position_ids: torch.Tensor | None = None  # (batch, seq)


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


async def forward_span(
    manager: SequenceManager, span: RouteSpan, hidden: torch.Tensor, args: ForwardArgs
) -> torch.Tensor:
    header = ForwardRequest(
        start_block=span.start,
        end_block=span.end,
        has_attention_mask=args.attention_mask is not None,
        has_position_ids=args.position_ids is not None,
    )
    tensors = [t for t in (hidden, args.attention_mask, args.position_ids) if t is not None]
    _, outputs = await call_span(manager, span.peer_id, "rpc_forward", header, tensors)
    if len(outputs) != 1 or outputs[0].shape != hidden.shape:
        raise RemoteCallError(f"forward reply has shapes {[tuple(o.shape) for o in outputs]}", span.peer_id)
    return outputs[0]


async def run_forward_chain(
    manager: SequenceManager, hidden: torch.Tensor, start: int, end: int, args: ForwardArgs
) -> tuple[torch.Tensor, list[Hop]]:
    """Hidden states after blocks [start, end), and the hops that produced them (with each hop's inputs)."""
    retry, hops, position = RetryBudget(manager), [], start
    tokens = hidden.shape[0] * hidden.shape[1]
    while position < end:
        route = await manager.make_route(position, end, tokens)
        for span in route:
            try:
                out = await forward_span(manager, span, hidden, args)
            except RemoteCallError as e:
                retry.failed(span, e)
                break  # re-route from the failed block on
            hops.append(Hop(span, hidden))
            hidden, position = out, span.end
    return hidden, hops
