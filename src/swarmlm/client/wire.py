"""Wire compression of activations, opted into per client (`wire_dtype`): fewer bytes on bandwidth-bound links.

float32 (the default) sends tensors as they are, bit for bit. bfloat16 and float16 halve the bytes: float32 tensors
(hidden states, gradients, prompts) are rounded to the wire dtype before sending; the server computes in its own
dtype and answers in the dtype it was sent (server.backend), and the client widens the reply back to float32.
int8 quarters them: the request's header says int8, and the codec sends every float tensor as int8 values with one
float32 scale per row of its last dimension (protocol/int8.py); the server reads them back as float32 and answers
the same way (also when it pushes a step on), and the client reads the reply as float32.
Integer tensors (masks, positions, hypo ids), under 16-bit wires tensors already narrower than float32, and under
every wire one-dimensional tensors (a LoRA's flat weights and their gradients: parameters, not activations, which a
lossy wire would corrupt) travel unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from swarmlm.models.constants import WIRE_DTYPE_NAMES
from swarmlm.protocol.int8 import compressible
from swarmlm.protocol.messages import _Header

# wire dtypes a client may choose; values: the dtype floats travel in
WIRE_DTYPES = {name: getattr(torch, name) for name in WIRE_DTYPE_NAMES}

H = TypeVar("H", bound=_Header)


def wire_dtype_of(name: str) -> torch.dtype:
    if name not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be one of {', '.join(WIRE_DTYPES)}, not {name!r}")
    return WIRE_DTYPES[name]


def _narrowed(dtype: torch.dtype, wire: torch.dtype) -> torch.dtype:
    if wire == torch.int8:  # the codec quantizes; the receiver reads float32
        return torch.float32 if dtype.is_floating_point else dtype
    return wire if dtype == torch.float32 else dtype


def marked(header: H, wire: torch.dtype) -> H:
    """The header of a request under this wire: with int8, one that says its tensors (and the reply's) are 8-bit."""
    if wire != torch.int8 or "int8" not in type(header).model_fields:
        return header
    return header.model_copy(update={"int8": True})


def to_wire(tensors: Sequence[torch.Tensor], wire: torch.dtype) -> list[torch.Tensor]:
    """The tensors as they travel: float32 activations rounded to a 16-bit `wire` (the same objects for float32 and
    int8, whose quantization the codec does)."""
    if wire not in (torch.bfloat16, torch.float16):
        return list(tensors)
    return [t.to(_narrowed(t.dtype, wire)) if compressible(t.dim()) else t for t in tensors]


def on_wire(dtypes: Sequence[torch.dtype], wire: torch.dtype, dims: Sequence[int] | None = None) -> list[torch.dtype]:
    """The dtypes a reply carries, as read, for replies of `dtypes` with `dims` dimensions (default: activations;
    the server answers in what it was sent)."""
    dims = [2] * len(dtypes) if dims is None else dims
    return [_narrowed(dtype, wire) if compressible(dim) else dtype for dtype, dim in zip(dtypes, dims, strict=True)]


def from_wire(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """A reply's tensors widened back to the dtypes the caller expects."""
    return [t if t.dtype == dtype else t.to(dtype) for t, dtype in zip(tensors, dtypes, strict=True)]
