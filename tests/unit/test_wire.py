"""Wire dtypes of activations: float32 is sent as is, narrower ones round only float32 tensors."""

from __future__ import annotations

import pytest
import torch

from swarmlm.client.wire import from_wire, on_wire, to_wire, wire_dtype_of


def test_float32_travels_as_the_very_same_tensors() -> None:
    tensors = [torch.randn(2, 3, 8), torch.ones(2, 3, dtype=torch.int64)]
    sent = to_wire(tensors, torch.float32)
    assert all(a is b for a, b in zip(sent, tensors, strict=True))
    assert on_wire([torch.float32, torch.bfloat16], torch.float32) == [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_narrow_wire_rounds_floats_only_and_widens_replies_back(name: str) -> None:
    wire = wire_dtype_of(name)
    hidden, mask, half = torch.randn(2, 3, 8), torch.ones(2, 3, dtype=torch.int64), torch.randn(2, dtype=torch.float16)
    sent = to_wire([hidden, mask, half], wire)
    assert [t.dtype for t in sent] == [wire, torch.int64, torch.float16]
    back = from_wire(sent[:1], [torch.float32])[0]
    assert back.dtype == torch.float32
    assert torch.allclose(back, hidden, rtol=2**-7, atol=0)  # bf16 keeps 8 significant bits, fp16 11


def test_unknown_wire_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="wire_dtype"):
        wire_dtype_of("int4")
