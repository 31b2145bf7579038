"""Every class of malformed request gets a clear error reply, and the server keeps serving everyone else."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgpack
import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from swarmlm.client.loop import LoopThread
from swarmlm.protocol import service
from swarmlm.protocol.codec import encode, read_message
from swarmlm.protocol.lora import LoraSpec
from swarmlm.protocol.messages import PROTOCOL_VERSION, BackwardRequest, ForwardRequest, ReplyHeader
from swarmlm.swarm.dht import start_dht
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm

MAX_TOKENS = 64


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator:
    with running_swarm(tiny_model_dir, [(0, 5)], extra_args=["--max-tokens-per-request", str(MAX_TOKENS)]) as swarm:
        yield swarm


class RawClient:
    """Sends hand-made request parts straight to a server, bypassing every client-side check."""

    def __init__(self, initial_peers: list[str], peer_id: str):
        self.dht = start_dht(initial_peers, host="127.0.0.1", client_mode=True)
        self.peer = PeerID.from_base58(peer_id)
        self.loop = LoopThread()
        self.p2p = self.loop.run(self.dht.replicate_p2p())

    def send(self, parts: list, method: str = "rpc_forward") -> tuple[ReplyHeader, list[torch.Tensor]]:
        async def call() -> tuple[ReplyHeader, list[torch.Tensor]]:
            async def stream() -> AsyncIterator[runtime_pb2.ExpertRequest]:
                for part in parts:
                    yield part

            replies = await getattr(service.stub(self.p2p, self.peer), method)(stream())
            return await read_message(replies, ReplyHeader, max_bytes=1 << 24)

        return self.loop.run(call())

    def forward(self, header: ForwardRequest | dict, tensors: list[torch.Tensor]) -> ReplyHeader:
        """Send to rpc_forward or rpc_backward, by the header's kind."""
        if isinstance(header, dict):  # a header no honest client would build
            parts = [runtime_pb2.ExpertRequest(metadata=msgpack.packb({"header": header, "n_tensors": len(tensors)}))]
            parts[0].tensors.extend(one_chunk(t) for t in tensors)
        else:
            parts = list(encode(header, tensors, runtime_pb2.ExpertRequest))
        kind = header["kind"] if isinstance(header, dict) else header.kind
        return self.send(parts, method=f"rpc_{kind}")[0]

    def close(self) -> None:
        self.loop.run(self.p2p.shutdown())
        self.loop.close()
        self.dht.shutdown()


@pytest.fixture(scope="module")
def raw(swarm) -> Iterator[RawClient]:
    client = RawClient(swarm.initial_peers, swarm.servers[0].peer_id)
    yield client
    client.close()


def one_chunk(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    serialized = serialize_torch_tensor(tensor)
    serialized.chunks = 1
    return serialized


def good_header(**overrides: object) -> ForwardRequest:
    return ForwardRequest(start_block=0, end_block=5, **overrides)


HIDDEN = torch.randn(1, 4, 64)
LORA = LoraSpec(rank=2, scaling=2.0, targets=("q_proj", "v_proj"))
V1 = {"protocol_version": PROTOCOL_VERSION, "kind": "forward", "start_block": 0, "end_block": 5}
CASES = {
    "empty block range": (ForwardRequest(start_block=3, end_block=3), [HIDDEN], "not served here"),
    "wrong hidden size": (good_header(), [torch.randn(1, 4, 63)], "hidden size 63"),
    "wrong rank": (good_header(), [torch.randn(4, 64)], "shape (batch, seq, 64)"),
    "wrong dtype": (good_header(), [torch.ones(1, 4, 64, dtype=torch.int64)], "must be float32"),
    "NaN values": (good_header(), [torch.full((1, 4, 64), float("nan"))], "NaN or infinite"),
    "infinite values": (good_header(), [torch.full((1, 4, 64), float("inf"))], "NaN or infinite"),
    "missing tensor": (good_header(tensors=["hidden", "position_ids"]), [HIDDEN], "names 2 tensors"),
    "bad mask shape": (
        good_header(tensors=["hidden", "attention_mask"]),
        [HIDDEN, torch.ones(1, 3)],
        "attention_mask",
    ),
    "positions beyond context": (
        good_header(tensors=["hidden", "position_ids"]),
        [HIDDEN, torch.full((1, 4), 10_000)],
        "position_ids must lie",
    ),
    "tensors out of order": (
        {**V1, "tensors": ["hidden", "prompts", "position_ids"]},
        [HIDDEN, HIDDEN, HIDDEN],
        "in the order",
    ),
    "tensor not allowed in a forward": (
        {**V1, "tensors": ["hidden", "grad_outputs"]},
        [HIDDEN, HIDDEN],
        "not expected",
    ),
    "sequence beyond the context": (good_header(), [torch.randn(1, 300, 64)], "longer than the model's context"),
    "unknown version": ({**V1, "protocol_version": 99}, [HIDDEN], "unsupported protocol version 99"),
    "unknown field": ({**V1, "sneaky": 1}, [HIDDEN], "Extra inputs are not permitted"),
    "wrongly typed field": ({**V1, "start_block": "0"}, [HIDDEN], "start_block"),
    "backward without gradients": (BackwardRequest(start_block=0, end_block=5), [HIDDEN], "carries grad_outputs"),
    "gradients of another shape": (
        BackwardRequest(start_block=0, end_block=5, tensors=["hidden", "grad_outputs"]),
        [HIDDEN, torch.randn(1, 3, 64)],
        "grad_outputs has shape",
    ),
    "NaN gradients": (
        BackwardRequest(start_block=0, end_block=5, tensors=["hidden", "grad_outputs"]),
        [HIDDEN, torch.full((1, 4, 64), float("nan"))],
        "NaN",
    ),
    "prompts for too few blocks": (
        BackwardRequest(start_block=0, end_block=5, tensors=["hidden", "grad_outputs", "prompts"]),
        [HIDDEN, HIDDEN, torch.zeros(4, 2, 64)],
        "prompts must have shape (5, prefix, 64) or (5, 1, prefix, 64)",
    ),
    "prompts longer than the sequence": (
        ForwardRequest(start_block=0, end_block=2, tensors=["hidden", "prompts"]),
        [HIDDEN, torch.zeros(2, 5, 64)],
        "prompts cover 5 positions",
    ),
    "NaN prompts": (
        ForwardRequest(start_block=1, end_block=2, tensors=["hidden", "prompts"]),
        [HIDDEN, torch.full((1, 2, 64), float("nan"))],
        "prompts contain NaN",
    ),
    # rank 2 on q_proj (64 -> 64) and v_proj (64 -> 32) of one block: 2 * (64 + 64) + 2 * (64 + 32) = 448 values
    "LoRA weights of the wrong size": (
        ForwardRequest(start_block=0, end_block=1, tensors=["hidden", "lora"], lora=LORA),
        [HIDDEN, torch.zeros(447)],
        "lora must be a flat tensor of 448 values",
    ),
    "LoRA weights as a matrix": (
        ForwardRequest(start_block=0, end_block=1, tensors=["hidden", "lora"], lora=LORA),
        [HIDDEN, torch.zeros(448, 1)],
        "lora must be a flat tensor of 448 values",
    ),
    "LoRA weights of too many blocks": (
        ForwardRequest(start_block=0, end_block=1, tensors=["hidden", "lora"], lora=LORA),
        [HIDDEN, torch.zeros(896)],
        "got shape (896,)",
    ),
    "NaN LoRA weights": (
        ForwardRequest(start_block=0, end_block=1, tensors=["hidden", "lora"], lora=LORA),
        [HIDDEN, torch.full((448,), float("nan"))],
        "lora contains NaN",
    ),
    "LoRA target the blocks lack": (
        ForwardRequest(
            start_block=0, end_block=1, tensors=["hidden", "lora"], lora=LoraSpec(rank=2, scaling=1.0, targets=("w",))
        ),
        [HIDDEN, torch.zeros(448)],
        "LoRA targets do not fit this model",
    ),
    "LoRA weights without their description": (
        ForwardRequest(start_block=0, end_block=1, tensors=["hidden", "lora"]),
        [HIDDEN, torch.zeros(448)],
        "travel as a 'lora' tensor",
    ),
    "LoRA rank above the limit": (
        {**V1, "tensors": ["hidden", "lora"], "lora": {"rank": 65, "scaling": 1.0, "targets": ["q_proj"]}},
        [HIDDEN, torch.zeros(8)],
        "lora.rank",
    ),
    "LoRA scaling not finite": (
        {**V1, "tensors": ["hidden", "lora"], "lora": {"rank": 2, "scaling": float("inf"), "targets": ["q_proj"]}},
        [HIDDEN, torch.zeros(8)],
        "lora.scaling",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_gets_a_clear_error(raw: RawClient, case: str) -> None:
    header, tensors, message = CASES[case]
    reply = raw.forward(header, tensors)
    assert not reply.ok and reply.error_kind == "bad_request"
    assert message in reply.error


def test_blocks_this_server_does_not_hold_are_not_served_not_bad(raw: RawClient) -> None:
    reply = raw.forward(ForwardRequest(start_block=3, end_block=9), [HIDDEN])
    # another server may hold them (the sender's view of this one was out of date): not the caller's error
    assert not reply.ok and reply.error_kind == "not_served" and "blocks 3:9 are not served here" in reply.error


def test_more_tokens_than_this_server_takes_is_too_large_not_bad(raw: RawClient) -> None:
    reply = raw.forward(good_header(), [torch.randn(2, MAX_TOKENS, 64)])
    # another server may take it (or the client splits the batch): not the caller's error
    assert not reply.ok and reply.error_kind == "too_large" and f"limit of {MAX_TOKENS}" in reply.error


def test_garbage_bytes_get_a_clear_error(raw: RawClient) -> None:
    reply, _ = raw.send([runtime_pb2.ExpertRequest(metadata=b"\xc1 not msgpack")])
    assert reply.error_kind == "bad_request" and "not valid msgpack" in reply.error
    broken = one_chunk(HIDDEN)
    broken.buffer = broken.buffer[:100]  # shape says 256 values, buffer holds 25
    part = runtime_pb2.ExpertRequest(metadata=msgpack.packb({"header": V1, "n_tensors": 1}), tensors=[broken])
    reply, _ = raw.send([part])
    assert reply.error_kind == "bad_request" and "cannot be decoded" in reply.error


def test_a_forward_header_sent_to_backward_is_refused(raw: RawClient) -> None:
    reply, _ = raw.send(list(encode(good_header(), [HIDDEN], runtime_pb2.ExpertRequest)), method="rpc_backward")
    assert reply.error_kind == "bad_request" and "kind" in reply.error


INT8_VALUES = torch.randint(-127, 128, (1, 4, 64), dtype=torch.int8)
MALFORMED_INT8 = {
    "int8 values in a message not marked int8": (False, [INT8_VALUES, torch.ones(1, 4)], "header says int8"),
    "too few scales": (True, [INT8_VALUES, torch.ones(1, 3)], "scales of shape (1, 4)"),
    "negative scales": (True, [INT8_VALUES, -torch.ones(1, 4)], "finite, positive"),
    "NaN scales": (True, [INT8_VALUES, torch.full((1, 4), float("nan"))], "finite, positive"),
    "missing scales": (True, [INT8_VALUES], "stream ended inside a message"),
}


@pytest.mark.parametrize("case", list(MALFORMED_INT8))
def test_malformed_int8_payloads_get_a_clear_error(raw: RawClient, case: str) -> None:
    int8, tensors, reason = MALFORMED_INT8[case]
    part = runtime_pb2.ExpertRequest(metadata=msgpack.packb({"header": {**V1, "int8": int8}, "n_tensors": 1}))
    part.tensors.extend(one_chunk(t) for t in tensors)
    reply, _ = raw.send([part])
    assert not reply.ok and reply.error_kind == "bad_request" and reason in reply.error, reply.error


def test_server_keeps_serving_after_bad_requests(raw: RawClient, swarm, tiny_model_dir: Path) -> None:
    for header, tensors, _ in CASES.values():
        raw.forward(header, tensors)
    assert swarm.servers[0].process.poll() is None
    ids = torch.randint(0, 128, (2, 6))
    with torch.inference_mode():
        expected = load_reference(tiny_model_dir)(ids).logits
    with connected_model(tiny_model_dir, swarm) as model:
        assert (model(ids).logits - expected).abs().max().item() <= LOGITS_ATOL
    with connected_model(tiny_model_dir, swarm, wire_dtype="int8") as model:  # also after malformed int8 payloads
        assert (model(ids).logits - expected).abs().max().item() <= 0.03
