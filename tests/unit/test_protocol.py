"""The wire format: messages survive the round trip, and every malformed message is refused with a reason."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import msgpack
import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarmlm.errors import ProtocolError
from swarmlm.net.frames import send_frames
from swarmlm.protocol.bundle import ReplyTensors, SpanTensors, check_names
from swarmlm.protocol.codec import CHUNK_BYTES, encode, read_message, read_only_message
from swarmlm.protocol.messages import PROTOCOL_VERSION, ForwardRequest, ReplyHeader


async def _aiter(parts: Iterable) -> AsyncIterator:
    for part in parts:
        yield part


def roundtrip(header: ForwardRequest, tensors: list[torch.Tensor], max_bytes: int = 1 << 30) -> tuple:
    parts = list(encode(header, tensors, runtime_pb2.ExpertRequest))
    return asyncio.run(read_only_message(_aiter(parts), ForwardRequest, max_bytes=max_bytes))


def test_header_and_tensors_survive_the_roundtrip() -> None:
    header = ForwardRequest(start_block=2, end_block=7, tensors=["hidden", "position_ids", "prompts"])
    tensors = [torch.randn(2, 3, 8), torch.arange(6).view(2, 3), torch.randn(2, 4).to(torch.bfloat16)]
    got_header, got = roundtrip(header, tensors)
    assert got_header == header
    for sent, received in zip(tensors, got, strict=True):
        assert received.dtype == sent.dtype and torch.equal(received, sent)


def test_tensors_above_the_transport_cap_travel_in_chunks() -> None:
    big = torch.randn(3, 1024, 1024)  # 12 MiB, three times the 4 MiB cap of one transport message
    parts = list(encode(ForwardRequest(start_block=0, end_block=1), [big], runtime_pb2.ExpertRequest))
    assert len(parts) >= 12 and all(part.ByteSize() <= CHUNK_BYTES + 4096 for part in parts)
    _, (received,) = roundtrip(ForwardRequest(start_block=0, end_block=1), [big])
    assert torch.equal(received, big)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool])
@pytest.mark.parametrize("shape", [(0, 3, 8), (1,), (3, 700, 333)], ids=["empty", "one", "several-chunks"])
def test_every_wire_dtype_and_size_survives_and_reads_as_hivemind_reads_it(dtype: torch.dtype, shape: tuple) -> None:
    """The parts are what hivemind's serialize and split would make of the tensor, so its readers (and older
    peers') read them; ours reads them back exactly."""
    tensor = (torch.randn(shape) * 100).to(dtype)
    parts = list(encode(ForwardRequest(start_block=0, end_block=1), [tensor], runtime_pb2.ExpertRequest))
    chunks = [chunk for part in parts for chunk in part.tensors]
    expected = list(split_for_streaming(serialize_torch_tensor(tensor), CHUNK_BYTES))
    assert [c.SerializeToString() for c in chunks[1:]] == [c.SerializeToString() for c in expected[1:]]
    assert chunks[0].buffer == expected[0].buffer and list(chunks[0].size) == list(expected[0].size)
    assert chunks[0].dtype == expected[0].dtype and chunks[0].chunks == max(1, expected[0].chunks)
    assert torch.equal(deserialize_torch_tensor(combine_from_streaming(chunks)), tensor)
    _, (received,) = roundtrip(ForwardRequest(start_block=0, end_block=1), [tensor])
    assert received.dtype == dtype and received.shape == tensor.shape and torch.equal(received, tensor)


def test_an_empty_stream_is_no_message() -> None:
    assert asyncio.run(read_message(_aiter([]), ForwardRequest, max_bytes=100)) is None


def _raw(header: object, n_tensors: int = 0) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=msgpack.packb({"header": header, "n_tensors": n_tensors}))


def _read(parts: list) -> tuple:
    return asyncio.run(read_only_message(_aiter(parts), ForwardRequest, max_bytes=1 << 20))


GOOD = {"protocol_version": PROTOCOL_VERSION, "kind": "forward", "start_block": 0, "end_block": 1}


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        ([runtime_pb2.ExpertRequest(metadata=b"\xc1")], "not valid msgpack"),
        ([runtime_pb2.ExpertRequest(metadata=msgpack.packb([1, 2]))], "must be {'header'"),
        ([_raw({**GOOD, "protocol_version": 0})], "unsupported protocol version 0"),
        ([_raw({k: v for k, v in GOOD.items() if k != "protocol_version"})], "unsupported protocol version None"),
        ([_raw({**GOOD, "extra": True})], "extra: Extra inputs are not permitted"),
        ([_raw({**GOOD, "end_block": 1.5})], "end_block"),
        ([_raw({**GOOD, "kind": "backward"})], "kind"),
        ([_raw({**GOOD, "start_block": -1})], "start_block"),
        ([_raw(GOOD, n_tensors=1)], "stream ended"),
        ([_raw(GOOD, n_tensors=99)], "0..16 tensors"),
        ([_raw(GOOD), _raw(GOOD)], "more than the one message"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_malformed_messages_are_refused_with_a_reason(parts: list, reason: str) -> None:
    with pytest.raises(ProtocolError, match=None) as info:
        _read(parts)
    assert reason in str(info.value)


def test_size_limit_is_enforced_while_reading() -> None:
    with pytest.raises(ProtocolError, match="more than 1000 bytes"):
        roundtrip(ForwardRequest(start_block=0, end_block=1), [torch.randn(1000)], max_bytes=1000)


def test_reply_header_is_strict_too() -> None:
    assert ReplyHeader(ok=False, error="x", error_kind="bad_request").error_kind == "bad_request"
    with pytest.raises(ValueError):
        ReplyHeader(ok=False, error_kind="oops")


def test_a_bundle_travels_in_wire_order_and_comes_back_whole() -> None:
    bundle = SpanTensors(torch.randn(2, 3, 8), position_ids=torch.arange(6).view(2, 3), prompts=torch.randn(4, 2, 8))
    header = ForwardRequest(start_block=0, end_block=4, tensors=bundle.names())
    got_header, tensors = roundtrip(header, bundle.tensors())
    back = SpanTensors.from_wire(got_header.tensors, tensors)
    assert back.names() == ["hidden", "position_ids", "prompts"]
    assert torch.equal(back.position_ids, bundle.position_ids) and back.attention_mask is None


@pytest.mark.parametrize(
    ("names", "reason"),
    [
        (["position_ids", "hidden"], "start with hidden"),
        (["hidden", "hidden"], "unique"),
        (["hidden", "prompts", "attention_mask"], "in the order"),
        (["hidden", "weights"], "not expected"),
    ],
)
def test_bundle_names_must_be_known_unique_and_ordered(names: list[str], reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        check_names(names)
    with pytest.raises(ValueError, match="tensors"):  # the header refuses them too
        ForwardRequest(start_block=0, end_block=1, tensors=names)


def test_a_bundle_splits_into_rows_with_its_per_sample_prompts() -> None:
    bundle = SpanTensors(torch.randn(4, 3, 8), attention_mask=torch.ones(4, 3), prompts=torch.randn(2, 4, 1, 8))
    rows = bundle.select_rows(1, 3)
    assert rows.hidden.shape == (2, 3, 8) and rows.attention_mask.shape == (2, 3)
    assert torch.equal(rows.prompts, bundle.prompts[:, 1:3])
    shared = SpanTensors(torch.randn(4, 3, 8), prompts=torch.randn(2, 1, 8)).select_rows(0, 1)
    assert shared.prompts.shape == (2, 1, 8)  # prompts shared by all rows stay whole


def reply_roundtrip(header: ReplyHeader, tensors: list[torch.Tensor]) -> tuple:
    parts = list(encode(header, tensors, runtime_pb2.ExpertResponse))
    return asyncio.run(read_only_message(_aiter(parts), ReplyHeader, max_bytes=1 << 30))


def test_a_reply_bundle_travels_named_and_comes_back_whole() -> None:
    bundle = ReplyTensors(grad_hidden=torch.randn(2, 3, 8), grad_lora=torch.randn(40))
    header, tensors = reply_roundtrip(ReplyHeader(ok=True, tensors=bundle.names()), bundle.tensors())
    back = ReplyTensors.from_wire(header.tensors, tensors, expected=["grad_hidden", "grad_lora"])
    assert header.tensors == ["grad_hidden", "grad_lora"] and back.hidden is None and back.grad_prompts is None
    assert torch.equal(back.required("grad_hidden"), bundle.grad_hidden)
    assert torch.equal(back.required("grad_lora"), bundle.grad_lora)
    with pytest.raises(ProtocolError, match="no grad_prompts"):
        back.required("grad_prompts")


def test_an_acknowledgement_carries_no_tensors() -> None:
    header, tensors = reply_roundtrip(ReplyHeader(ok=True), [])
    assert header.tensors == [] and ReplyTensors.from_wire(header.tensors, tensors, expected=[]).names() == []


@pytest.mark.parametrize(
    ("names", "reason"),
    [
        (["hidden", "weights"], "unknown"),
        (["attention_mask"], "unknown"),  # a request's name is not a reply's
        (["grad_hidden", "grad_hidden"], "unique"),
        (["grad_lora", "grad_hidden"], "in the order"),
    ],
)
def test_reply_names_must_be_known_unique_and_ordered(names: list[str], reason: str) -> None:
    tensors = [torch.zeros(1) for _ in names]
    with pytest.raises(ProtocolError, match=reason):
        ReplyTensors.from_wire(names, tensors)
    with pytest.raises(ValueError, match="tensors"):  # the header refuses them too
        ReplyHeader(ok=True, tensors=names)
    raw = msgpack.packb(
        {"header": {"protocol_version": PROTOCOL_VERSION, "ok": True, "tensors": names}, "n_tensors": 0}
    )
    with pytest.raises(ProtocolError, match="malformed ReplyHeader"):  # as it arrives from the network
        asyncio.run(read_message(_aiter([runtime_pb2.ExpertResponse(metadata=raw)]), ReplyHeader, max_bytes=0))


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["hidden"], ["grad_hidden", "grad_prompts"]),  # a forward's reply to a backward
        (["grad_hidden"], ["grad_hidden", "grad_prompts"]),  # the prompts' gradient is missing
        (["grad_hidden", "grad_lora"], ["grad_hidden"]),  # a gradient nobody asked for
        ([], ["hidden"]),  # an acknowledgement where a step's output was due
    ],
)
def test_a_reply_must_carry_exactly_what_its_request_asked_for(names: list[str], expected: list[str]) -> None:
    with pytest.raises(ProtocolError, match="the request asked for"):
        ReplyTensors.from_wire(names, [torch.zeros(1) for _ in names], expected=expected)


def test_reply_names_and_tensors_must_agree_and_refusals_carry_none() -> None:
    with pytest.raises(ProtocolError, match="names 1 tensors but the reply carries 2"):
        ReplyTensors.from_wire(["hidden"], [torch.zeros(1), torch.zeros(1)], expected=["hidden"])
    with pytest.raises(ValueError, match="a refusal carries no tensors"):
        ReplyHeader(ok=False, error="x", error_kind="server", tensors=["hidden"])


def test_peers_of_another_protocol_version_refuse_each_other_clearly() -> None:
    raw = msgpack.packb({"header": {"protocol_version": PROTOCOL_VERSION - 1, "ok": True}, "n_tensors": 1})
    with pytest.raises(ProtocolError, match="unsupported protocol version"):
        asyncio.run(read_message(_aiter([runtime_pb2.ExpertResponse(metadata=raw)]), ReplyHeader, max_bytes=1 << 20))


class _Writes:
    """The writing end of a stream, as asyncio's StreamWriter is used by the framing: it keeps each write's bytes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    async def drain(self) -> None:
        return None


def test_frames_are_hiveminds_bytes_written_in_one_call() -> None:
    parts = list(encode(ForwardRequest(start_block=0, end_block=1), [torch.randn(2, 3)], runtime_pb2.ExpertRequest))
    messages = [*parts, RPCError(message="done")]
    ours, theirs = _Writes(), _Writes()

    async def write_both() -> None:
        await send_frames(ours, messages)  # type: ignore[arg-type]
        for message in messages:
            await P2P.send_protobuf(message, theirs)  # type: ignore[arg-type]

    asyncio.run(write_both())
    assert len(ours.writes) == 1 and ours.writes[0] == b"".join(theirs.writes)

    async def read_back() -> list:
        reader = asyncio.StreamReader()
        reader.feed_data(ours.writes[0])
        reader.feed_eof()
        return [await P2P.receive_protobuf(runtime_pb2.ExpertRequest, reader) for _ in messages]

    got = asyncio.run(read_back())
    assert [message for message, _ in got[:-1]] == parts and got[-1][1].message == "done"


def _resident_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (the peak since it was last reset) of this process, in MB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def test_a_message_is_read_into_its_tensors_as_its_parts_arrive() -> None:
    """Each part's bytes go straight into the tensor and the part is dropped: reading a 64 MiB message (parts made
    as they are taken, as they arrive off a stream) peaks at about the tensor's size, not at its parts and its
    tensor at once; and a sender that declares 64 MiB and sends one part makes the reader hold about that part."""
    big = torch.randn(16, 1024, 1024)
    header = ForwardRequest(start_block=0, end_block=1)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak (VmHWM) starts again from now
    before = _resident_mb("VmRSS")
    _, (received,) = asyncio.run(read_only_message(_aiter(encode(header, [big], runtime_pb2.ExpertRequest)),
                                                   ForwardRequest, max_bytes=1 << 30))  # fmt: skip
    peak = _resident_mb("VmHWM") - before
    assert torch.equal(received, big)
    assert peak < 64 + 24, f"reading a 64 MiB message peaked {peak:.0f} MB above where it began"
    del received

    async def stalled() -> float:
        parts = encode(header, [big], runtime_pb2.ExpertRequest)
        arrived: asyncio.Queue = asyncio.Queue()
        for _ in range(2):
            arrived.put_nowait(next(parts))

        async def stream() -> AsyncIterator:
            while True:
                yield await arrived.get()

        reading = asyncio.ensure_future(read_message(stream(), ForwardRequest, max_bytes=1 << 30))
        start = _resident_mb("VmRSS")
        await asyncio.sleep(0.1)  # the reader takes both parts and waits for the third
        held = _resident_mb("VmRSS") - start
        reading.cancel()
        return held

    held = asyncio.run(stalled())
    assert held < 16, f"a message stalled after 2 of its 64 parts holds {held:.0f} MB"
