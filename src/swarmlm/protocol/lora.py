"""LoRA weights that travel with a request: the header's description of them and the layout of their one flat tensor.

The client owns the LoRA matrices of every block it trains and sends them with each forward, backward or inference
step, as one flat tensor: for each block of the request in order, for each adapted module of the block (sorted by
name), A (rank, in) and then B (out, rank), row-major. The header names the rank, the scaling and the target module
names; each side derives every matrix's shape from its own modules (lora_layout), so a server never builds anything
whose size it did not compute itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

# highest rank a request may carry: it bounds what one request can make a server read and allocate (PEFT's default
# is 8; ranks beyond 64 are rare)
MAX_LORA_RANK = 64
# most target module names in one request (a block has fewer Linear modules than this)
MAX_LORA_TARGETS = 16
# a target is a module name or its last components, as in PEFT's target_modules (e.g. "q_proj", "self_attn.q_proj")
TARGET_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,63}(\.[A-Za-z0-9_]{1,64}){0,7}$"

# (module name within a block, in_features, out_features)
Module = tuple[str, int, int]


class LoraSpec(BaseModel):
    """What a request's flat "lora" tensor holds: rank, scaling (PEFT's lora_alpha / r) and the adapted modules."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    rank: int = Field(ge=1, le=MAX_LORA_RANK)
    scaling: float = Field(allow_inf_nan=False)
    targets: tuple[Annotated[str, Field(pattern=TARGET_PATTERN)], ...] = Field(
        min_length=1, max_length=MAX_LORA_TARGETS, strict=False
    )

    @field_validator("targets")
    @classmethod
    def _distinct(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(targets)) != len(targets):
            raise ValueError(f"targets must be distinct, got {list(targets)}")
        return targets


def matches(name: str, target: str) -> bool:
    """Whether module `name` (within a block) is adapted by `target`, as PEFT matches a target_modules entry."""
    return name == target or name.endswith("." + target)


@dataclass(frozen=True)
class LoraLayout:
    """Where each block's matrices lie in a flat tensor of consecutive blocks."""

    rank: int
    modules: tuple[tuple[Module, ...], ...]  # per block: its adapted modules, sorted by name
    bounds: tuple[int, ...]  # block i's values are flat[bounds[i]:bounds[i + 1]]

    @property
    def size(self) -> int:
        return self.bounds[-1]

    def blocks(self, begin: int, end: int) -> LoraLayout:
        """The layout of blocks [begin, end) of this one (indices relative to its first block)."""
        offset = self.bounds[begin]
        return LoraLayout(self.rank, self.modules[begin:end], tuple(b - offset for b in self.bounds[begin : end + 1]))

    def matrices(self, flat: torch.Tensor, block: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(module name, A (rank, in), B (out, rank)) of one block: views into flat (which holds the whole layout)."""
        found, offset, rank = [], self.bounds[block], self.rank
        for name, fan_in, fan_out in self.modules[block]:
            a = flat[offset : offset + rank * fan_in].view(rank, fan_in)
            offset += rank * fan_in
            b = flat[offset : offset + fan_out * rank].view(fan_out, rank)
            offset += fan_out * rank
            found.append((name, a, b))
        return found


def lora_layout(shapes: Sequence[Mapping[str, tuple[int, int]]], rank: int, targets: Sequence[str]) -> LoraLayout:
    """The layout of LoRA matrices of `rank` on the modules matching `targets` in blocks whose Linear modules have
    `shapes` (name -> (in, out), one mapping per block). ValueError when a target matches no module of a block."""
    modules, bounds = [], [0]
    for index, block in enumerate(shapes):
        missing = [t for t in targets if not any(matches(name, t) for name in block)]
        if missing:
            raise ValueError(f"target modules {missing} are not Linear modules of block {index}")
        adapted = tuple((name, *block[name]) for name in sorted(block) if any(matches(name, t) for t in targets))
        modules.append(adapted)
        bounds.append(bounds[-1] + sum(rank * (fan_in + fan_out) for _, fan_in, fan_out in adapted))
    return LoraLayout(rank, tuple(modules), tuple(bounds))


@dataclass(frozen=True)
class LoraWeights:
    """LoRA matrices of blocks [first, first + len(layout.modules)), as one flat tensor laid out by `layout`."""

    spec: LoraSpec
    layout: LoraLayout
    flat: torch.Tensor  # (layout.size,)
    first: int  # global index of the first block

    @property
    def end(self) -> int:
        return self.first + len(self.layout.modules)

    def blocks(self, start: int, end: int) -> LoraWeights:
        """The weights of global blocks [start, end) (a view of the same values)."""
        if not self.first <= start < end <= self.end:
            raise ValueError(f"blocks {start}:{end} are outside the LoRA weights' {self.first}:{self.end}")
        layout = self.layout.blocks(start - self.first, end - self.first)
        begin = self.layout.bounds[start - self.first]
        return LoraWeights(self.spec, layout, self.flat[begin : begin + layout.size], start)

    def with_flat(self, flat: torch.Tensor) -> LoraWeights:
        return LoraWeights(self.spec, self.layout, flat, self.first)


def peft_scaling(rank: int, alpha: float) -> float:
    """PEFT's LoRA scaling (without rsLoRA): alpha / rank."""
    scaling = alpha / rank
    if not math.isfinite(scaling):
        raise ValueError(f"lora_alpha {alpha} gives no finite scaling")
    return scaling
