"""Forward and backward requests of different peers joined into one computation along the batch dimension.

Requests over the same blocks whose tensors agree in everything but the batch size (sequence length, dtypes, which
optional tensors travel, prompt length) run as one: their rows are concatenated, deep prompts shared by a request's
rows are expanded to per-row prompts so that each request keeps its own, and the results are cut back per request
(a shared prompt's gradient is the sum over its rows, as autograd through the expansion gives). Pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarmlm.protocol.bundle import SpanTensors


@dataclass(frozen=True, eq=False)
class JoinableRequest:
    """A forward or backward request that may share one computation with others over the same blocks."""

    start: int  # blocks [start, end): only requests over the same blocks join
    end: int
    inputs: SpanTensors
    peer: str = ""  # who sent it (for the log)

    @property
    def tokens(self) -> int:
        return self.inputs.hidden.shape[0] * self.inputs.hidden.shape[1]


def _signature(inputs: SpanTensors) -> tuple[object, ...]:
    """What must be equal for two requests to join: everything but the batch size."""
    prompts = inputs.prompts
    return (
        inputs.hidden.shape[1:],
        inputs.hidden.dtype,
        None if inputs.grad_outputs is None else inputs.grad_outputs.dtype,
        None if inputs.attention_mask is None else (inputs.attention_mask.shape[1:], inputs.attention_mask.dtype),
        None if inputs.position_ids is None else (inputs.position_ids.shape[1:], inputs.position_ids.dtype),
        inputs.hypo_ids is not None,
        None if prompts is None else (prompts.shape[0], prompts.shape[-2:], prompts.dtype),
    )


def can_join(a: JoinableRequest, b: JoinableRequest) -> bool:
    """Requests with their own LoRA weights never join: each runs with its own weights, alone."""
    if a.inputs.lora is not None or b.inputs.lora is not None:
        return False
    return (
        (a.start, a.end) == (b.start, b.end)
        and a.inputs.hypo_ids is None
        and _signature(a.inputs) == _signature(b.inputs)
    )


def _per_row_prompts(inputs: SpanTensors) -> torch.Tensor | None:
    """Deep prompts as (blocks, batch, prefix, hidden): shared ones repeated for each of the request's rows."""
    prompts = inputs.prompts
    if prompts is None or prompts.ndim == 4:
        return prompts
    return prompts.unsqueeze(1).expand(-1, inputs.hidden.shape[0], -1, -1)


def join(requests: Sequence[JoinableRequest]) -> SpanTensors:
    """One bundle of all requests' rows, in order (the requests must be pairwise joinable)."""
    parts = [r.inputs for r in requests]

    def cat(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values)

    prompts = [_per_row_prompts(p) for p in parts]
    return SpanTensors(
        hidden=torch.cat([p.hidden for p in parts]),
        grad_outputs=cat("grad_outputs"),
        attention_mask=cat("attention_mask"),
        position_ids=cat("position_ids"),
        prompts=None if prompts[0] is None else torch.cat([p for p in prompts if p is not None], dim=1),
    )


def split(results: Sequence[torch.Tensor], requests: Sequence[JoinableRequest]) -> list[list[torch.Tensor]]:
    """The joined computation's results cut per request: hidden states (or their gradient) by rows, and the
    gradient of each request's prompts in the shape it sent them."""
    outputs: list[list[torch.Tensor]] = [[] for _ in requests]
    begin = 0
    for index, request in enumerate(requests):
        rows = request.inputs.hidden.shape[0]
        outputs[index].append(results[0][begin : begin + rows].contiguous())
        if len(results) > 1:  # backward with prompts: (blocks, total rows, prefix, hidden)
            grad = results[1][:, begin : begin + rows]
            prompts = request.inputs.prompts
            outputs[index].append(grad.sum(dim=1) if prompts is not None and prompts.ndim == 3 else grad.contiguous())
        begin += rows
    return outputs
