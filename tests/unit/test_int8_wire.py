"""8-bit wire form (wire_dtype="int8"): per-row absmax quantization, its round trip through the codec, its size, and
the refusal of malformed 8-bit payloads."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import msgpack
import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2

from swarmlm.client.wire import marked, on_wire, to_wire, wire_dtype_of
from swarmlm.errors import ProtocolError
from swarmlm.protocol.codec import encode, read_only_message
from swarmlm.protocol.int8 import MAX_SCALE, dequantize_rows, quantize_rows
from swarmlm.protocol.messages import ForwardRequest, InfoRequest, ReplyHeader

HIDDEN = 576  # SmolLM2's hidden size


async def _aiter(parts: Iterable) -> AsyncIterator:
    for part in parts:
        yield part


def roundtrip(parts: list, max_bytes: int = 1 << 30) -> tuple:
    return asyncio.run(read_only_message(_aiter(parts), ForwardRequest, max_bytes=max_bytes))


def test_each_value_moves_by_at_most_half_a_step_of_its_rows_scale() -> None:
    x = torch.randn(3, 7, 64) * torch.logspace(-3, 3, 7).view(1, 7, 1)  # rows of very different magnitudes
    x[0, 0] = 0.0  # an all-zero row
    q, scales = quantize_rows(x)
    assert q.dtype == torch.int8 and scales.shape == (3, 7) and bool((scales > 0).all())
    back = dequantize_rows(q, scales, 0)
    assert torch.equal(back[0, 0], torch.zeros(64))
    assert bool(((back - x).abs() <= scales.unsqueeze(-1) / 2 * (1 + 1e-5)).all())
    # each row keeps its own scale: the small rows are as precise, relative to their size, as the large ones
    relative = (back - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30)
    assert relative.max() <= 0.5 / 127 + 1e-6


def test_an_int8_message_round_trips_to_float32_and_is_four_times_smaller() -> None:
    hidden = torch.randn(2, 16, HIDDEN)
    mask, positions = torch.ones(2, 16, dtype=torch.int64), torch.arange(16).repeat(2, 1)
    names = ["hidden", "attention_mask", "position_ids"]
    plain = list(encode(ForwardRequest(start_block=0, end_block=1, tensors=names), [hidden, mask, positions],
                        runtime_pb2.ExpertRequest))  # fmt: skip
    header = ForwardRequest(start_block=0, end_block=1, tensors=names, int8=True)
    small = list(encode(header, [hidden], runtime_pb2.ExpertRequest))
    big = list(encode(ForwardRequest(start_block=0, end_block=1), [hidden], runtime_pb2.ExpertRequest))
    ratio = sum(p.ByteSize() for p in big) / sum(p.ByteSize() for p in small)
    assert 3.8 <= ratio <= 4.0  # 4 bytes per value against 1, plus one float32 scale per row of 576
    got_header, (got_hidden, got_mask, got_positions) = roundtrip(
        list(encode(header, [hidden, mask, positions], runtime_pb2.ExpertRequest))
    )
    assert got_header.int8 and got_hidden.dtype == torch.float32
    assert (got_hidden - hidden).abs().max() <= hidden.abs().amax(-1).max() / 254 * (1 + 1e-5)
    assert torch.equal(got_mask, mask) and torch.equal(got_positions, positions)  # integers travel unchanged
    # without int8 in the header, float32 travels bit for bit
    _, (exact, _, _) = roundtrip(plain)
    assert torch.equal(exact, hidden)


def test_the_client_marks_only_tensor_headers_and_sends_float32_to_the_codec() -> None:
    wire = wire_dtype_of("int8")
    header = ForwardRequest(start_block=0, end_block=1)
    assert marked(header, wire).int8 and not marked(header, torch.bfloat16).int8
    assert marked(InfoRequest(), wire) == InfoRequest()
    hidden = torch.randn(1, 2, 8)
    assert to_wire([hidden], wire)[0] is hidden
    assert on_wire([torch.float32, torch.bfloat16, torch.int64], wire) == [torch.float32, torch.float32, torch.int64]
    assert ReplyHeader(ok=True, int8=True).int8


def chunk(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    serialized = serialize_torch_tensor(tensor)
    serialized.chunks = 1
    return serialized


def hostile(tensors: list[torch.Tensor], int8: bool = True) -> list:
    """One part: a forward header (int8 or not) naming one tensor, followed by these serialized tensors."""
    header = ForwardRequest(start_block=0, end_block=1, int8=int8).model_dump()
    part = runtime_pb2.ExpertRequest(metadata=msgpack.packb({"header": header, "n_tensors": 1}))
    part.tensors.extend(chunk(t) for t in tensors)
    return [part]


Q = torch.randint(-127, 128, (1, 4, 8), dtype=torch.int8)
MALFORMED = {
    "int8 values in a message not marked int8": (hostile([Q, torch.ones(1, 4)], int8=False), "header says int8"),
    "too few scales": (hostile([Q, torch.ones(1, 3)]), "scales of shape (1, 4)"),
    "scales of another dtype": (hostile([Q, torch.ones(1, 4, dtype=torch.float16)]), "float32 scales"),
    "zero scale": (hostile([Q, torch.tensor([[1.0, 0.0, 1.0, 1.0]])]), "finite, positive"),
    "negative scale": (hostile([Q, -torch.ones(1, 4)]), "finite, positive"),
    "NaN scale": (hostile([Q, torch.full((1, 4), float("nan"))]), "finite, positive"),
    "infinite scale": (hostile([Q, torch.full((1, 4), float("inf"))]), "finite, positive"),
    "scale that overflows": (hostile([Q, torch.full((1, 4), MAX_SCALE * 2)]), "at most"),
    "missing scales": (hostile([Q]), "stream ended inside a message"),
    "int8 scalar": (hostile([torch.tensor(3, dtype=torch.int8), torch.ones(())]), "at least one dimension"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_int8_payloads_are_refused_with_a_reason(case: str) -> None:
    parts, reason = MALFORMED[case]
    with pytest.raises(ProtocolError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        roundtrip(parts)


def test_lora_weights_travel_exactly_under_every_wire() -> None:
    # parameters, not activations: a LoRA's flat weights (and gradients) pass a lossy wire bit for bit
    hidden, lora = torch.randn(1, 4, HIDDEN), torch.cat([torch.randn(1000), torch.randn(1000) * 1e-4])
    header = ForwardRequest(start_block=0, end_block=1, tensors=["hidden", "lora"], int8=True)
    _, (got_hidden, got_lora) = roundtrip(list(encode(header, [hidden, lora], runtime_pb2.ExpertRequest)))
    assert torch.equal(got_lora, lora) and not torch.equal(got_hidden, hidden)
    for wire in ("bfloat16", "float16"):
        sent_hidden, sent_lora = to_wire([hidden, lora], wire_dtype_of(wire))
        assert sent_hidden.dtype == wire_dtype_of(wire) and sent_lora is lora
        assert on_wire([torch.float32, torch.float32], wire_dtype_of(wire), [3, 1]) == [wire_dtype_of(wire),
                                                                                      torch.float32]  # fmt: skip
