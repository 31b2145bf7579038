"""The typed bundles of tensors span messages carry, and the only place that knows their order on the wire.

Requests carry a SpanTensors, replies a ReplyTensors. The sender builds one, sends `names()` in the header and
`tensors()` after it, and the receiver rebuilds it with `from_wire(header.tensors, tensors)`. Shapes and values are
checked by the receiver (server.validation, client.span_call); this module checks only that the names are known,
unique and in wire order, and for a reply that they are exactly those its request asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal, get_args

import torch

from swarmlm.errors import ProtocolError

TensorName = Literal["hidden", "grad_outputs", "attention_mask", "position_ids", "hypo_ids", "prompts", "lora"]
# wire order of the tensors of a request: the order of SpanTensors' fields
WIRE_ORDER: tuple[TensorName, ...] = get_args(TensorName)
ReplyName = Literal["hidden", "grad_hidden", "grad_prompts", "grad_lora"]
# wire order of the tensors of a reply: the order of ReplyTensors' fields
REPLY_ORDER: tuple[ReplyName, ...] = get_args(ReplyName)


@dataclass(frozen=True)
class SpanTensors:
    """What travels with a span's hidden states, in either direction of a forward, backward or inference step."""

    hidden: torch.Tensor  # (batch, seq, hidden); seq may be 0 in an inference step (a no-op)
    grad_outputs: torch.Tensor | None = None  # (batch, seq, hidden): gradient wrt the span's output (backward)
    attention_mask: torch.Tensor | None = None  # (batch, past + seq) of 0/1
    position_ids: torch.Tensor | None = None  # (batch, seq) absolute positions
    hypo_ids: torch.Tensor | None = None  # (batch,) cache rows to reorder to before an inference step (beam search)
    prompts: torch.Tensor | None = None  # deep prompts (blocks, prefix, hidden), or per sample (blocks, batch, ...)
    lora: torch.Tensor | None = None  # (values,) the LoRA matrices of the message's blocks (protocol.lora)

    def names(self) -> list[TensorName]:
        """Names of the tensors present, in wire order (the header's `tensors` field)."""
        return [name for name in WIRE_ORDER if getattr(self, name) is not None]

    def tensors(self) -> list[torch.Tensor]:
        """The tensors present, in wire order."""
        return [getattr(self, name) for name in self.names()]

    @classmethod
    def from_wire(cls, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> SpanTensors:
        """Rebuild a bundle from a header's names and the tensors that followed it."""
        check_names(names)
        if len(names) != len(tensors):
            raise ProtocolError(f"the header names {len(names)} tensors but the message carries {len(tensors)}")
        return cls(**dict(zip(names, tensors, strict=True)))

    def select_rows(self, begin: int, end: int) -> SpanTensors:
        """The bundle of batch rows [begin, end) (hypo_ids, which index rows, cannot be split)."""
        if self.hypo_ids is not None:
            raise ValueError("a bundle with hypo_ids cannot be split into rows")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("hidden", "grad_outputs", "attention_mask", "position_ids"):
            if values[name] is not None:
                values[name] = values[name][begin:end]
        if self.prompts is not None and self.prompts.ndim == 4:  # per sample
            values["prompts"] = self.prompts[:, begin:end]
        return SpanTensors(**values)


@dataclass(frozen=True)
class ReplyTensors:
    """What a reply carries: the output hidden states (forward, inference step) or the gradients of a backward.

    A backward's reply carries grad_hidden, and grad_prompts / grad_lora exactly when its request sent prompts /
    LoRA weights; an open or a push acknowledgement carries nothing.
    """

    hidden: torch.Tensor | None = None  # (batch, seq, hidden): the span's output (forward, inference step)
    grad_hidden: torch.Tensor | None = None  # (batch, seq, hidden): gradient wrt the span's input (backward)
    grad_prompts: torch.Tensor | None = None  # gradient wrt the request's prompts, shaped like them (backward)
    grad_lora: torch.Tensor | None = None  # (values,) gradient wrt the request's LoRA weights, laid out like them

    def names(self) -> list[ReplyName]:
        """Names of the tensors present, in wire order (the reply header's `tensors` field)."""
        return [name for name in REPLY_ORDER if getattr(self, name) is not None]

    def tensors(self) -> list[torch.Tensor]:
        """The tensors present, in wire order."""
        return [getattr(self, name) for name in self.names()]

    def required(self, name: ReplyName) -> torch.Tensor:
        """The tensor `name`, which the reply must carry (from_wire with `expected` already made sure it does)."""
        tensor: torch.Tensor | None = getattr(self, name)
        if tensor is None:
            raise ProtocolError(f"the reply carries no {name}")
        return tensor

    @classmethod
    def from_wire(
        cls, names: Sequence[str], tensors: Sequence[torch.Tensor], expected: Sequence[str] | None = None
    ) -> ReplyTensors:
        """Rebuild a reply from its header's names and the tensors that followed it; with `expected`, the names must
        be exactly those (the tensors the request asked for)."""
        check_reply_names(names, expected)
        if len(names) != len(tensors):
            raise ProtocolError(f"the reply header names {len(names)} tensors but the reply carries {len(tensors)}")
        return cls(**dict(zip(names, tensors, strict=True)))


def check_names(names: Sequence[str], allowed: Sequence[str] = WIRE_ORDER) -> None:
    """Names must start with hidden, be known here and allowed in this message kind, unique, and in wire order."""
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise ProtocolError(f"tensors {unknown} are not expected in this message; allowed: {list(allowed)}")
    if not names or names[0] != "hidden":
        raise ProtocolError("a message's tensors start with hidden")
    _check_order(names, WIRE_ORDER)


def check_reply_names(names: Sequence[str], expected: Sequence[str] | None = None) -> None:
    """A reply's names must be known, unique and in wire order, and with `expected`, exactly those (in any order)."""
    unknown = [name for name in names if name not in REPLY_ORDER]
    if unknown:
        raise ProtocolError(f"reply tensors {unknown} are unknown; known: {list(REPLY_ORDER)}")
    _check_order(names, REPLY_ORDER)
    if expected is not None and sorted(names) != sorted(expected):
        raise ProtocolError(f"the reply carries tensors {list(names)}, the request asked for {list(expected)}")


def _check_order(names: Sequence[str], order: Sequence[str]) -> None:
    positions = [order.index(name) for name in names]
    if positions != sorted(set(positions)):
        raise ProtocolError(f"tensors must be unique and in the order {list(order)}, got {list(names)}")
