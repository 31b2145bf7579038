"""Wire compression of activations, opted into per client (`wire_dtype`): fewer bytes on bandwidth-bound links.

float32 (the default) sends tensors as they are, bit for bit. bfloat16 and float16 halve the bytes: float32 tensors
(hidden states, gradients, prompts) are rounded to the wire dtype before sending; the server computes in its own
dtype and answers in the dtype it was sent (server.backend), and the client widens the reply back to float32.
Integer tensors (masks, positions, hypo ids) and tensors already narrower than float32 travel unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# wire dtypes a client may choose; values: the dtype floats travel in
WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def wire_dtype_of(name: str) -> torch.dtype:
    if name not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be one of {', '.join(WIRE_DTYPES)}, not {name!r}")
    return WIRE_DTYPES[name]


def _narrowed(dtype: torch.dtype, wire: torch.dtype) -> torch.dtype:
    return wire if dtype == torch.float32 else dtype


def to_wire(tensors: Sequence[torch.Tensor], wire: torch.dtype) -> list[torch.Tensor]:
    """The tensors as they travel: float32 ones rounded to `wire` (the same objects when wire is float32)."""
    return [t.to(_narrowed(t.dtype, wire)) if wire != torch.float32 else t for t in tensors]


def on_wire(dtypes: Sequence[torch.dtype], wire: torch.dtype) -> list[torch.dtype]:
    """The dtypes a reply carries on the wire for replies of `dtypes` (the server answers in what it was sent)."""
    return [_narrowed(dtype, wire) for dtype in dtypes]


def from_wire(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """A reply's tensors widened back to the dtypes the caller expects."""
    return [t if t.dtype == dtype else t.to(dtype) for t, dtype in zip(tensors, dtypes, strict=True)]
