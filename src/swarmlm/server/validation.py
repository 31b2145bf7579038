"""Checks of everything a request carries, raising ProtocolError with a message the sender can act on."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import ParamSpec, TypeVar

import torch

from swarmlm.errors import ProtocolError
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.protocol.lora import LoraSpec, LoraWeights, lora_layout
from swarmlm.protocol.messages import BackwardRequest, ForwardRequest, InferenceOpen, InferenceStep
from swarmlm.server.peers import LimitError

P = ParamSpec("P")
R = TypeVar("R")
# what torch raises on a tensor no check foresaw (an empty one, an odd dtype): still the sender's malformed input
_TENSOR_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)

# dtypes hidden states may arrive in; the server computes in its own dtype and answers in the sender's
HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)
# bytes per value of the largest hidden-state dtype
_BYTES_PER_HIDDEN_VALUE = 4
# messages up to this multiple of the token limit are read in full, so the checks can say what is wrong (a backward
# request carries hidden states and their gradients); larger ones are cut off while arriving
_READ_SLACK = 4
# room for deep prompts and headers beyond the per-token tensors
_EXTRA_MESSAGE_BYTES = 8 << 20


def max_message_bytes(max_tokens: int, hidden_size: int) -> int:
    """The most tensor bytes a server reads of one request or inference step before refusing it (a request's own
    LoRA weights count against it too)."""
    token_bytes = hidden_size * _BYTES_PER_HIDDEN_VALUE + 16  # hidden states (or gradients), mask and position
    return _READ_SLACK * max_tokens * token_bytes + _EXTRA_MESSAGE_BYTES


def _refusing_crashes(check: Callable[P, R]) -> Callable[P, R]:
    """`check`, with a torch error on an input it did not foresee raised as ProtocolError: the sender gets a
    bad_request reply like for any malformed input, and its inference session goes on."""

    @functools.wraps(check)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return check(*args, **kwargs)
        except _TENSOR_ERRORS as e:
            raise ProtocolError(f"malformed tensors: {type(e).__name__}: {e}") from e

    return checked


@dataclass(frozen=True)
class SpanLimits:
    start: int  # first block this server serves
    end: int  # one past its last block
    hidden_size: int
    max_tokens: int  # batch * sequence tokens one request may carry
    max_position: int  # positions must be below this (the model's context)
    adapters: tuple[str, ...] = ()  # LoRA adapters a request may name
    # per block of the span: its Linear modules, name -> (in, out): what a request's own LoRA weights may adapt
    linear_shapes: tuple[Mapping[str, tuple[int, int]], ...] = ()


# refusals of requests for what this server does not hold: the sender read an old or false announcement of it, and
# another server may hold it (the client re-reads the swarm and re-routes at once, instead of calling it a bad request)
NOT_SERVED = "not_served"


def check_adapter(adapter: str | None, limits: SpanLimits) -> None:
    if adapter is not None and adapter not in limits.adapters:
        served = ", ".join(limits.adapters) or "none"
        raise LimitError(f"adapter {adapter!r} is not served here (adapters served: {served})", NOT_SERVED)


def check_blocks(start: int, end: int, limits: SpanLimits) -> None:
    if start >= end:  # names no block: malformed wherever it is sent
        raise ProtocolError(f"blocks {start}:{end} are not served here: an empty range")
    if not limits.start <= start < end <= limits.end:
        raise LimitError(
            f"blocks {start}:{end} are not served here: this server serves {limits.start}:{limits.end}", NOT_SERVED
        )


def check_hidden(hidden: torch.Tensor, limits: SpanLimits, what: str = "hidden_states", min_seq: int = 1) -> None:
    if hidden.dtype not in HIDDEN_DTYPES:
        raise ProtocolError(f"{what} must be float32, bfloat16 or float16, not {hidden.dtype}")
    if hidden.ndim != 3 or hidden.shape[0] < 1 or hidden.shape[1] < min_seq:
        raise ProtocolError(f"{what} must have shape (batch, seq, {limits.hidden_size}), got {tuple(hidden.shape)}")
    if hidden.shape[2] != limits.hidden_size:
        raise ProtocolError(f"{what} has hidden size {hidden.shape[2]}, this model's is {limits.hidden_size}")
    if hidden.shape[1] > limits.max_position:
        raise ProtocolError(
            f"{what} has {hidden.shape[1]} positions, longer than the model's context of {limits.max_position}"
        )
    tokens = hidden.shape[0] * hidden.shape[1]
    if tokens > limits.max_tokens:
        raise LimitError(
            f"{what} carries {tokens} tokens, more than this server's limit of {limits.max_tokens}: split the batch",
            "too_large",  # another server may accept it
        )
    if not torch.isfinite(hidden).all():
        raise ProtocolError(f"{what} contains NaN or infinite values")


def _check_index_tensor(tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tensor.dtype not in INDEX_DTYPES and tensor.dtype != torch.bool:
        raise ProtocolError(f"{what} must be an integer tensor, not {tensor.dtype}")
    if tuple(tensor.shape) != shape:
        raise ProtocolError(f"{what} must have shape {shape}, got {tuple(tensor.shape)}")


def _checked_mask(mask: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    _check_index_tensor(mask, (batch, length), "attention_mask")
    if not ((mask == 0) | (mask == 1)).all():
        raise ProtocolError("attention_mask may only hold 0 and 1")
    return mask.to(torch.int64)


def _within(values: torch.Tensor, low: int, high: int) -> bool:
    """Whether every value lies in [low, high): true of an empty tensor, whose min() and max() would raise."""
    return values.numel() == 0 or (int(values.min()) >= low and int(values.max()) < high)


def _checked_positions(positions: torch.Tensor, batch: int, seq: int, limits: SpanLimits) -> torch.Tensor:
    _check_index_tensor(positions, (batch, seq), "position_ids")
    if positions.dtype == torch.bool or not _within(positions, 0, limits.max_position):
        raise ProtocolError(f"position_ids must lie in [0, {limits.max_position})")
    return positions.to(torch.int64)


def check_prompts(
    prompts: torch.Tensor, blocks: int, batch: int, seq: int, limits: SpanLimits, any_length: bool = False
) -> None:
    """Deep prompts: (blocks, prefix, hidden) shared by all rows, or (blocks, batch, prefix, hidden) per sample."""
    if prompts.dtype not in HIDDEN_DTYPES:
        raise ProtocolError(f"prompts must be float32, bfloat16 or float16, not {prompts.dtype}")
    per_sample = prompts.ndim == 4
    if (
        prompts.ndim not in (3, 4)
        or prompts.shape[0] != blocks
        or prompts.shape[-1] != limits.hidden_size
        or (per_sample and prompts.shape[1] != batch)
    ):
        raise ProtocolError(
            f"prompts must have shape ({blocks}, prefix, {limits.hidden_size}) or ({blocks}, {batch}, prefix, "
            f"{limits.hidden_size}) for {blocks} blocks and batch {batch}, got {tuple(prompts.shape)}"
        )
    if not 1 <= prompts.shape[-2] <= (limits.max_position if any_length else seq):
        raise ProtocolError(f"prompts cover {prompts.shape[-2]} positions; the sequence has {seq}")
    if not torch.isfinite(prompts).all():
        raise ProtocolError("prompts contain NaN or infinite values")


@_refusing_crashes
def check_lora(
    spec: LoraSpec | None, flat: torch.Tensor | None, start: int, end: int, limits: SpanLimits,
    adapter: str | None = None,
) -> LoraWeights | None:  # fmt: skip
    """A request's own LoRA weights of blocks [start, end): the header describes them, this server derives every
    matrix's shape from its own modules, and the tensor must hold exactly that many finite values."""
    if spec is None and flat is None:
        return None
    if spec is None or flat is None:
        raise ProtocolError("LoRA weights travel as a 'lora' tensor together with the header's 'lora' field")
    if adapter is not None:
        raise ProtocolError("a request carries either its own LoRA weights or names a served adapter, not both")
    try:
        layout = lora_layout(limits.linear_shapes[start - limits.start : end - limits.start], spec.rank, spec.targets)
    except ValueError as e:
        raise ProtocolError(f"LoRA targets do not fit this model: {e}") from e
    if flat.ndim != 1 or flat.numel() != layout.size:
        raise ProtocolError(
            f"lora must be a flat tensor of {layout.size} values (rank {spec.rank} on {list(spec.targets)} of "
            f"blocks {start}:{end}), got shape {tuple(flat.shape)}"
        )
    if flat.dtype not in HIDDEN_DTYPES:
        raise ProtocolError(f"lora must be float32, bfloat16 or float16, not {flat.dtype}")
    if not torch.isfinite(flat).all():
        raise ProtocolError("lora contains NaN or infinite values")
    return LoraWeights(spec, layout, flat, start)


@_refusing_crashes
def check_span_request(header: ForwardRequest, tensors: list[torch.Tensor], limits: SpanLimits) -> SpanTensors:
    """Validate a forward or backward request and return its bundle, with index tensors as int64."""
    check_blocks(header.start_block, header.end_block, limits)
    check_adapter(header.adapter, limits)
    if isinstance(header, BackwardRequest) and "grad_outputs" not in header.tensors:
        raise ProtocolError("a backward request carries grad_outputs")
    bundle = SpanTensors.from_wire(header.tensors, tensors)
    check_hidden(bundle.hidden, limits)
    batch, seq = bundle.hidden.shape[:2]
    if bundle.grad_outputs is not None:
        check_hidden(bundle.grad_outputs, limits, what="grad_outputs")
        if bundle.grad_outputs.shape != bundle.hidden.shape:
            raise ProtocolError(
                f"grad_outputs has shape {tuple(bundle.grad_outputs.shape)}, not {tuple(bundle.hidden.shape)}"
            )
    if bundle.prompts is not None:
        check_prompts(bundle.prompts, header.end_block - header.start_block, batch, seq, limits)
    mask, positions = bundle.attention_mask, bundle.position_ids
    return replace(
        bundle,
        attention_mask=None if mask is None else _checked_mask(mask, batch, seq),
        position_ids=None if positions is None else _checked_positions(positions, batch, seq, limits),
    )


def check_open(header: InferenceOpen, limits: SpanLimits) -> None:
    check_blocks(header.start_block, header.end_block, limits)
    check_adapter(header.adapter, limits)
    if header.max_length > limits.max_position:
        raise ProtocolError(f"max_length {header.max_length} exceeds the model's context of {limits.max_position}")


@_refusing_crashes
def check_step(
    header: InferenceStep, tensors: list[torch.Tensor], limits: SpanLimits, session: InferenceOpen, past: int
) -> SpanTensors:
    """Validate one step of an open session that holds `past` tokens (before any rollback the step asks for)."""
    bundle = SpanTensors.from_wire(header.tensors, tensors)
    check_hidden(bundle.hidden, limits, min_seq=0)
    batch, seq = bundle.hidden.shape[:2]
    if batch != session.batch_size:
        raise ProtocolError(f"step has batch {batch}; the session was opened for batch {session.batch_size}")
    if header.start_from_position is not None:
        if header.start_from_position > past:
            raise ProtocolError(
                f"start_from_position {header.start_from_position} is beyond the {past} tokens the session holds"
            )
        past = header.start_from_position
    if past + seq > session.max_length:
        raise ProtocolError(
            f"step would take the session to {past + seq} tokens, beyond its max_length of {session.max_length}"
        )
    mask, positions, hypo_ids = bundle.attention_mask, bundle.position_ids, bundle.hypo_ids
    if mask is not None:
        mask = _checked_mask(mask, batch, past + seq)
    if positions is not None:
        positions = _checked_positions(positions, batch, seq, limits)
    if hypo_ids is not None:
        _check_index_tensor(hypo_ids, (batch,), "hypo_ids")
        if hypo_ids.dtype == torch.bool or not _within(hypo_ids, 0, batch):
            raise ProtocolError(f"hypo_ids must lie in [0, {batch})")
        hypo_ids = hypo_ids.to(torch.int64)
    if bundle.prompts is not None:
        blocks = session.end_block - session.start_block
        check_prompts(bundle.prompts, blocks, batch, max(seq, 1), limits, any_length=True)
    return replace(bundle, attention_mask=mask, position_ids=positions, hypo_ids=hypo_ids)
