"""Peers that send odd-but-parseable steps, cut their streams mid-message or stall mid-message, against a real server
process: each gets a reply of its own kind (or nothing, once gone), sessions stay usable where the stream does, and
the server's log stays short and free of tracebacks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from swarmlm.protocol.codec import CHUNK_BYTES, encode, read_message
from swarmlm.protocol.messages import ForwardRequest, InferenceOpen, InferenceStep, ReplyHeader
from tests.conftest import running_swarm
from tests.integration.test_bad_requests import RawClient
from tests.integration.test_hostile_peers import frame, open_raw, read_reply, reply_parts, write

ARRIVAL_TIMEOUT_S = 1.0
FORWARD = ForwardRequest(start_block=0, end_block=5)
OPEN = InferenceOpen(start_block=0, end_block=5, batch_size=1, max_length=16)
CUTS = 24  # peers cutting their streams mid-message
# log lines the cuts may add: the sessions' own open/close lines (info), and at most a few rate-limited warnings
MAX_LINES_PER_CUT = 3
MAX_WARNINGS = 6


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator:
    with running_swarm(tiny_model_dir, [(0, 5)], extra_args=["--arrival-timeout", str(ARRIVAL_TIMEOUT_S)]) as swarm:
        yield swarm


@pytest.fixture
def raw(swarm) -> Iterator[RawClient]:
    client = RawClient(swarm.initial_peers, swarm.servers[0].peer_id)
    yield client
    client.close()


def log_text(swarm) -> str:
    return swarm.servers[0].log_path.read_text(errors="replace")


def message(header: object, tensors: list[torch.Tensor]) -> bytes:
    return b"".join(frame(part) for part in encode(header, tensors, runtime_pb2.ExpertRequest))


def opened_session(raw: RawClient) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = open_raw(raw, "rpc_inference")
    write(raw, writer, message(OPEN, []))
    assert read_reply(raw, reader).ok
    return reader, writer


def read_step(raw: RawClient, reader: asyncio.StreamReader) -> tuple[ReplyHeader, list[torch.Tensor]]:
    async def call() -> tuple[ReplyHeader, list[torch.Tensor]]:
        found = await asyncio.wait_for(read_message(reply_parts(reader), ReplyHeader, max_bytes=1 << 20), 10.0)
        assert found is not None, "the server closed the session's stream"
        return found

    return raw.loop.run(call())


def test_an_empty_step_with_positions_is_answered_and_the_session_goes_on(raw: RawClient) -> None:
    reader, writer = opened_session(raw)
    empty = InferenceStep(tensors=["hidden", "position_ids"])
    write(raw, writer, message(empty, [torch.zeros(1, 0, 64), torch.zeros(1, 0, dtype=torch.int64)]))
    reply, outputs = read_step(raw, reader)
    assert reply.ok and outputs[0].shape == (1, 0, 64)
    bad = InferenceStep(tensors=["hidden", "position_ids"])  # positions of the wrong length: refused, session kept
    write(raw, writer, message(bad, [torch.zeros(1, 0, 64), torch.zeros(1, 3, dtype=torch.int64)]))
    reply, _ = read_step(raw, reader)
    assert reply.error_kind == "bad_request" and "position_ids" in reply.error
    write(raw, writer, message(InferenceStep(), [torch.randn(1, 2, 64)]))
    reply, outputs = read_step(raw, reader)
    assert reply.ok and outputs[0].shape == (1, 2, 64)


def first_part_of_a_big_forward() -> bytes:
    """The first of the parts of a 2 MiB forward request (the rest never follows)."""
    chunks = list(split_for_streaming(serialize_torch_tensor(torch.zeros(1, 8192, 64)), CHUNK_BYTES))
    assert len(chunks) > 1
    header = msgpack.packb({"header": FORWARD.model_dump(), "n_tensors": 1})
    return frame(runtime_pb2.ExpertRequest(metadata=header, tensors=chunks[:1]))


def cut(raw: RawClient, writer: asyncio.StreamWriter) -> None:
    async def abort() -> None:
        writer.transport.abort()

    raw.loop.run(abort())


def test_peers_that_cut_their_streams_mid_message_leave_a_short_log_without_tracebacks(swarm, raw: RawClient) -> None:
    before = len(log_text(swarm).splitlines())
    step = message(InferenceStep(), [torch.randn(1, 4, 64)])
    big_step = list(encode(InferenceStep(), [torch.randn(1, 8192, 64)], runtime_pb2.ExpertRequest))  # 2 MiB
    assert len(big_step) > 1
    for index in range(CUTS):
        if index % 3 == 0:  # a session's step cut after its first part
            _, writer = opened_session(raw)
            write(raw, writer, frame(big_step[0]))
        elif index % 3 == 1:  # a session's step cut in the middle of its frame
            _, writer = opened_session(raw)
            write(raw, writer, step[: len(step) // 2])
        else:  # a forward request cut after its first part
            _, writer = open_raw(raw, "rpc_forward")
            write(raw, writer, first_part_of_a_big_forward())
        cut(raw, writer)
    time.sleep(2.0)  # the server notices every cut
    reply = raw.forward(FORWARD, [torch.randn(1, 4, 64)])  # and still serves this peer
    assert reply.ok
    lines = log_text(swarm).splitlines()[before:]
    text = "\n".join(lines)
    assert "Traceback" not in text and "never retrieved" not in text, text
    assert len(lines) <= MAX_LINES_PER_CUT * CUTS, text
    assert sum(" WARNING " in line or " ERROR " in line for line in lines) <= MAX_WARNINGS, text


@pytest.mark.parametrize("where", ["between parts", "inside a frame"])
def test_a_forward_that_stops_arriving_is_refused_early_as_a_timeout(swarm, raw: RawClient, where: str) -> None:
    reader, writer = open_raw(raw, "rpc_forward")
    began = time.monotonic()
    if where == "between parts":
        write(raw, writer, first_part_of_a_big_forward())
    else:
        write(raw, writer, P2P.MESSAGE_MARKER + (4096).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + bytes(100))
    reply = read_reply(raw, reader, timeout=ARRIVAL_TIMEOUT_S + 10)
    assert reply is not None and reply.error_kind == "timeout" and "stopped arriving" in reply.error, reply
    assert time.monotonic() - began < ARRIVAL_TIMEOUT_S + 5
    assert "Traceback" not in log_text(swarm)


def test_a_step_that_stops_arriving_is_refused_as_a_timeout_and_ends_its_session(raw: RawClient) -> None:
    reader, writer = opened_session(raw)
    step = message(InferenceStep(), [torch.randn(1, 4, 64)])
    write(raw, writer, step[: len(step) // 2])
    reply, _ = read_step(raw, reader)
    assert reply.error_kind == "timeout", reply
    reader2, writer2 = opened_session(raw)  # the peer's next session is served as usual
    write(raw, writer2, step)
    reply, outputs = read_step(raw, reader2)
    assert reply.ok and outputs[0].shape == (1, 4, 64)
