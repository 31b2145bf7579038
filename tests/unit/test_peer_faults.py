"""What a hostile peer can make a server do, without sockets: empty tensors, stalled messages, broken reads, log
floods and impossible DHT records are refused or contained, each with one clear reason."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator

import pytest
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils import ValueWithExpiration

from swarmlm.errors import LimitError, ProtocolError
from swarmlm.net import transport
from swarmlm.net.arrival import arriving
from swarmlm.net.peerlog import PeerFaults
from swarmlm.net.streams import PeerStream
from swarmlm.protocol.codec import encode
from swarmlm.protocol.messages import InferenceOpen, InferenceStep
from swarmlm.server import inference
from swarmlm.server.validation import SpanLimits, check_step
from swarmlm.swarm.dht import why_not_stored
from swarmlm.swarm.records import MAX_BLOCKS, ServerRecord

LIMITS = SpanLimits(start=0, end=5, hidden_size=8, max_tokens=64, max_position=128)
SESSION = InferenceOpen(start_block=0, end_block=5, batch_size=1, max_length=32)


def step(names: list[str], tensors: list[torch.Tensor], past: int = 0) -> object:
    return check_step(InferenceStep(tensors=names), tensors, LIMITS, SESSION, past)


def test_an_empty_step_with_positions_is_a_valid_no_op() -> None:
    checked = step(["hidden", "position_ids"], [torch.zeros(1, 0, 8), torch.zeros(1, 0, dtype=torch.int64)], past=3)
    assert checked.hidden.shape == (1, 0, 8) and checked.position_ids.shape == (1, 0)


@pytest.mark.parametrize(
    ("names", "tensors", "reason"),
    [
        (["hidden", "position_ids"], [torch.zeros(1, 2, 8), torch.tensor([[0, 128]])], "position_ids must lie"),
        (["hidden", "hypo_ids"], [torch.zeros(1, 1, 8), torch.tensor([1])], "hypo_ids must lie"),
        (["hidden", "position_ids"], [torch.zeros(1, 0, 8), torch.zeros(1, 1, dtype=torch.int64)], "shape (1, 0)"),
    ],
)
def test_bad_indices_are_refused_with_a_reason(names: list[str], tensors: list[torch.Tensor], reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        step(names, tensors)


def test_a_torch_error_on_an_unforeseen_input_is_a_protocol_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("min(): Expected reduction dim to be specified for input.numel() == 0")

    monkeypatch.setattr("swarmlm.server.validation.check_hidden", crash)
    with pytest.raises(ProtocolError, match="malformed tensors: RuntimeError: min"):
        step(["hidden"], [torch.zeros(1, 1, 8)])


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_peer_faults_log_one_line_per_peer_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock, log = FakeClock(), logging.getLogger("test.faults")
    faults = PeerFaults(interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.faults"):
        shown = [faults.warning(log, "peer-a", "bad request peer=%s", "a") for _ in range(100)]
        assert faults.warning(log, "peer-b", "bad request peer=%s", "b")  # another peer has its own allowance
        clock.now = 10.0
        assert faults.warning(log, "peer-a", "bad request peer=%s", "a")
    assert shown.count(True) == 1
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "bad request peer=a",
        "bad request peer=b",
        "bad request peer=a (and 99 more from this peer in 10 s)",
    ]


def test_many_peers_together_get_a_bounded_number_of_lines(caplog: pytest.LogCaptureFixture) -> None:
    """Identities are free: a thousand peers each with one fault write at most max_lines lines per interval, and the
    next interval says how many were left out."""
    clock, log = FakeClock(), logging.getLogger("test.faults")
    faults = PeerFaults(interval_s=10.0, clock=clock, max_lines=20)
    with caplog.at_level(logging.WARNING, logger="test.faults"):
        shown = [faults.warning(log, f"sybil-{i}", "bad request") for i in range(1000)]
        clock.now = 10.0
        assert faults.warning(log, "sybil-999", "bad request")
    assert shown.count(True) == 20
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 22
    assert lines[-2] == "980 more lines about peers' faults were left out in 10 s (too many peers at once)"
    assert lines[-1] == "bad request (and 1 more from this peer in 10 s)"


def test_peer_faults_remember_a_bounded_number_of_peers() -> None:
    faults = PeerFaults(capacity=3, clock=FakeClock())
    for peer in range(10):
        faults.warning(logging.getLogger("test.faults"), str(peer), "fault")
    assert len(faults._peers) == 3


async def _parts(*delays: float) -> AsyncIterator[int]:
    for index, delay in enumerate(delays):
        await asyncio.sleep(delay)
        yield index


def test_a_message_that_stops_arriving_is_refused_as_a_timeout() -> None:
    async def main() -> list[int]:
        got = []
        async for part in arriving(_parts(0.3, 0.0, 0.5), timeout_s=0.2):  # the first part may take its time
            got.append(part)
        return got

    with pytest.raises(LimitError, match="stopped arriving") as refused:
        asyncio.run(main())
    assert refused.value.error_kind == "timeout"


def test_a_message_whose_parts_keep_coming_is_read_whole() -> None:
    async def main() -> list[int]:
        return [part async for part in arriving(_parts(0.0, 0.1, 0.1, 0.1), timeout_s=0.2)]

    assert asyncio.run(main()) == [0, 1, 2, 3]


def test_a_frame_body_that_stops_arriving_is_refused_as_a_timeout() -> None:
    limits = transport.StreamLimits(
        max_frame_bytes=1 << 20, read_timeout_s=5.0, write_timeout_s=1.0, arrival_timeout_s=0.2
    )

    async def main() -> bytes:
        reader = asyncio.StreamReader()
        stream = transport._Stream("peer", reader, None, limits)  # type: ignore[arg-type]
        reader.feed_data(b"half")
        return await stream._read_body(8)

    with pytest.raises(LimitError, match="stopped arriving") as refused:
        asyncio.run(main())
    assert refused.value.error_kind == "timeout"


def test_a_frame_body_arriving_in_pieces_is_read_whole() -> None:
    limits = transport.StreamLimits(
        max_frame_bytes=1 << 20, read_timeout_s=5.0, write_timeout_s=1.0, arrival_timeout_s=0.2
    )

    async def main() -> bytes:
        reader = asyncio.StreamReader()
        stream = transport._Stream("peer", reader, None, limits)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        for delay, piece in ((0.1, b"ab"), (0.2, b"cd"), (0.3, b"ef")):
            loop.call_later(delay, reader.feed_data, piece)
        return await stream._read_body(6)

    assert asyncio.run(main()) == b"abcdef"


def test_a_read_that_failed_as_its_session_ended_leaves_no_unretrieved_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The peer cut its stream mid-step just as its session ended: the failed read's error is taken, not left for
    asyncio to log with a traceback when the read is collected."""

    async def cut() -> AsyncIterator[object]:
        raise ProtocolError("the stream ended inside a message")
        yield  # an async generator

    async def main() -> None:
        reader = inference._Reader(cut(), max_bytes=1 << 20, arrival_timeout_s=1.0)
        read = reader.next()
        await asyncio.sleep(0.01)
        assert read.done()
        await reader.cancel()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def _record(**fields: object) -> dict:
    return {"state": "online", "start": 0, "end": 5, "throughput": 1.0, "dtype": "float32", **fields}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"start": 5, "end": 2}, "must be below end"),
        ({"start": 3, "end": 3}, "must be below end"),
        ({"end": 2**63 - 1}, "less than or equal to"),
        ({"end": MAX_BLOCKS + 1}, "less than or equal to"),
    ],
)
def test_records_of_impossible_spans_are_refused(fields: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        ServerRecord.model_validate(_record(**fields))


def test_a_record_of_a_sane_span_is_read() -> None:
    assert ServerRecord.model_validate(_record(start=2, end=MAX_BLOCKS)).end == MAX_BLOCKS


OURS = {"state": "online", "start": 0, "end": 5}


@pytest.mark.parametrize(
    ("found", "reason"),
    [
        (ValueWithExpiration({"me": ValueWithExpiration(OURS, 100.0)}, 100.0), None),
        (ValueWithExpiration({"me": ValueWithExpiration(OURS, 130.0)}, 130.0), None),  # refreshed since
        (None, "no replica took it"),
        (ValueWithExpiration(b"squatter", 1e12), "holds a bytes value"),
        (ValueWithExpiration({"other": ValueWithExpiration(OURS, 1e12)}, 1e12), "other subkeys' values, not ours"),
        (ValueWithExpiration({"me": ValueWithExpiration(OURS, 70.0)}, 70.0), "older value of ours"),
        (ValueWithExpiration({"me": ValueWithExpiration({"end": 9}, 100.0)}, 100.0), "different value"),
    ],
)
def test_a_store_hivemind_calls_failed_fails_only_when_the_value_is_not_there(found: object, reason: str) -> None:
    """A rogue replica's refusal (or later-dated values under other subkeys) fails hivemind's store result; the
    value read back decides, and says what is wrong."""
    why = why_not_stored(found, "me", OURS, expiration=100.0)
    assert why is None if reason is None else reason in why


class StalledWriter:
    """A stream writer whose peer never reads: its buffer never drains."""

    def __init__(self) -> None:
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data

    async def drain(self) -> None:
        await asyncio.sleep(3600)


def test_a_write_to_a_peer_that_stopped_reading_times_out_on_its_own() -> None:
    async def main() -> None:
        stream = PeerStream(asyncio.StreamReader(), StalledWriter(), "rpc_inference", io_timeout_s=0.2)  # type: ignore[arg-type]
        await stream.send(encode(InferenceStep(), [torch.zeros(1, 1, 8)], runtime_pb2.ExpertRequest))

    began = time.monotonic()
    with pytest.raises(TimeoutError, match="rpc_inference: waited 0.2 s for the peer to take our request"):
        asyncio.run(main())
    assert time.monotonic() - began < 2.0
