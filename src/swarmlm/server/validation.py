"""Checks of everything a request carries, raising ProtocolError with a message the sender can act on."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from swarmlm.errors import ProtocolError
from swarmlm.protocol.messages import BackwardRequest, ForwardRequest, InferenceOpen, InferenceStep

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
    """The most tensor bytes a server reads of one request or inference step before refusing it."""
    token_bytes = hidden_size * _BYTES_PER_HIDDEN_VALUE + 16  # hidden states (or gradients), mask and position
    return _READ_SLACK * max_tokens * token_bytes + _EXTRA_MESSAGE_BYTES


@dataclass(frozen=True)
class SpanLimits:
    start: int  # first block this server serves
    end: int  # one past its last block
    hidden_size: int
    max_tokens: int  # batch * sequence tokens one request may carry
    max_position: int  # positions must be below this (the model's context)


@dataclass(frozen=True)
class SpanInputs:
    hidden: torch.Tensor  # (batch, seq, hidden)
    attention_mask: torch.Tensor | None = None  # (batch, seq) of 0/1
    position_ids: torch.Tensor | None = None  # (batch, seq)
    prompts: torch.Tensor | None = None  # (blocks, prefix, hidden) deep prompts
    grad_outputs: torch.Tensor | None = None  # (batch, seq, hidden), backward only
    hypo_ids: torch.Tensor | None = None  # (batch,) cache rows to reorder to before an inference step


def check_blocks(start: int, end: int, limits: SpanLimits) -> None:
    if not limits.start <= start < end <= limits.end:
        raise ProtocolError(
            f"blocks {start}:{end} are not served here: this server serves {limits.start}:{limits.end}"
        )


def check_hidden(hidden: torch.Tensor, limits: SpanLimits, what: str = "hidden_states") -> None:
    if hidden.dtype not in HIDDEN_DTYPES:
        raise ProtocolError(f"{what} must be float32, bfloat16 or float16, not {hidden.dtype}")
    if hidden.ndim != 3 or hidden.shape[0] < 1 or hidden.shape[1] < 1:
        raise ProtocolError(f"{what} must have shape (batch, seq, {limits.hidden_size}), got {tuple(hidden.shape)}")
    if hidden.shape[2] != limits.hidden_size:
        raise ProtocolError(f"{what} has hidden size {hidden.shape[2]}, this model's is {limits.hidden_size}")
    tokens = hidden.shape[0] * hidden.shape[1]
    if tokens > limits.max_tokens:
        raise ProtocolError(
            f"{what} carries {tokens} tokens, more than this server's limit of {limits.max_tokens}: split the batch"
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


def _checked_positions(positions: torch.Tensor, batch: int, seq: int, limits: SpanLimits) -> torch.Tensor:
    _check_index_tensor(positions, (batch, seq), "position_ids")
    if positions.dtype == torch.bool or positions.min() < 0 or positions.max() >= limits.max_position:
        raise ProtocolError(f"position_ids must lie in [0, {limits.max_position})")
    return positions.to(torch.int64)


def check_prompts(prompts: torch.Tensor, blocks: int, seq: int, limits: SpanLimits, any_length: bool = False) -> None:
    if prompts.dtype not in HIDDEN_DTYPES:
        raise ProtocolError(f"prompts must be float32, bfloat16 or float16, not {prompts.dtype}")
    if prompts.ndim != 3 or prompts.shape[0] != blocks or prompts.shape[2] != limits.hidden_size:
        raise ProtocolError(
            f"prompts must have shape ({blocks}, prefix, {limits.hidden_size}) for {blocks} blocks, "
            f"got {tuple(prompts.shape)}"
        )
    if not 1 <= prompts.shape[1] <= (limits.max_position if any_length else seq):
        raise ProtocolError(f"prompts cover {prompts.shape[1]} positions; the sequence has {seq}")
    if not torch.isfinite(prompts).all():
        raise ProtocolError("prompts contain NaN or infinite values")


def _hidden_first(
    tensors: list[torch.Tensor], expected: int, what: str, limits: SpanLimits
) -> tuple[torch.Tensor, Iterator[torch.Tensor]]:
    """The checked hidden states a message starts with, and an iterator over the tensors after them."""
    if len(tensors) != expected:
        raise ProtocolError(f"{what} declares {expected} tensors but carries {len(tensors)}")
    rest = iter(tensors)
    hidden = next(rest)
    check_hidden(hidden, limits)
    return hidden, rest


def check_span_request(header: ForwardRequest, tensors: list[torch.Tensor], limits: SpanLimits) -> SpanInputs:
    """Validate a forward or backward request and return its typed inputs."""
    check_blocks(header.start_block, header.end_block, limits)
    backward = isinstance(header, BackwardRequest)
    expected = 1 + backward + header.has_attention_mask + header.has_position_ids + header.has_prompts
    hidden, rest = _hidden_first(tensors, expected, f"{header.kind} request", limits)
    batch, seq = hidden.shape[:2]
    if seq > limits.max_position:
        raise ProtocolError(f"a sequence of {seq} tokens exceeds the model's context of {limits.max_position}")
    grad_outputs = mask = positions = prompts = None
    if backward:
        grad_outputs = next(rest)
        check_hidden(grad_outputs, limits, what="grad_outputs")
        if grad_outputs.shape != hidden.shape:
            raise ProtocolError(f"grad_outputs has shape {tuple(grad_outputs.shape)}, not {tuple(hidden.shape)}")
    if header.has_attention_mask:
        mask = _checked_mask(next(rest), batch, seq)
    if header.has_position_ids:
        positions = _checked_positions(next(rest), batch, seq, limits)
    if header.has_prompts:
        prompts = next(rest)
        check_prompts(prompts, header.end_block - header.start_block, seq, limits)
    return SpanInputs(hidden, mask, positions, prompts, grad_outputs)


def check_open(header: InferenceOpen, limits: SpanLimits) -> None:
    check_blocks(header.start_block, header.end_block, limits)
    if header.max_length > limits.max_position:
        raise ProtocolError(f"max_length {header.max_length} exceeds the model's context of {limits.max_position}")


def check_step(
    header: InferenceStep, tensors: list[torch.Tensor], limits: SpanLimits, session: InferenceOpen, past: int
) -> SpanInputs:
    """Validate one step of an open session that already holds `past` tokens."""
    expected = 1 + header.has_attention_mask + header.has_position_ids + header.has_hypo_ids + header.has_prompts
    hidden, rest = _hidden_first(tensors, expected, "step", limits)
    batch, seq = hidden.shape[:2]
    if batch != session.batch_size:
        raise ProtocolError(f"step has batch {batch}; the session was opened for batch {session.batch_size}")
    if past + seq > session.max_length:
        raise ProtocolError(
            f"step would take the session to {past + seq} tokens, beyond its max_length of {session.max_length}"
        )
    mask = positions = hypo_ids = prompts = None
    if header.has_attention_mask:
        mask = _checked_mask(next(rest), batch, past + seq)
    if header.has_position_ids:
        positions = _checked_positions(next(rest), batch, seq, limits)
    if header.has_hypo_ids:
        hypo_ids = next(rest)
        _check_index_tensor(hypo_ids, (batch,), "hypo_ids")
        if hypo_ids.dtype == torch.bool or hypo_ids.min() < 0 or hypo_ids.max() >= batch:
            raise ProtocolError(f"hypo_ids must lie in [0, {batch})")
        hypo_ids = hypo_ids.to(torch.int64)
    if header.has_prompts:
        prompts = next(rest)
        check_prompts(prompts, session.end_block - session.start_block, max(seq, 1), limits, any_length=True)
    return SpanInputs(hidden, mask, positions, prompts, hypo_ids=hypo_ids)
