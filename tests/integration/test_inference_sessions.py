"""Server-side inference sessions over a real stream: cache budget, idle expiry, bad steps, exactness of the cache."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from hivemind.proto import runtime_pb2
from transformers.cache_utils import DynamicCache

from swarmlm.client.loop import LoopThread
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.span_call import RerouteError, SpanStream
from swarmlm.config import ClientConfig
from swarmlm.errors import BadRequestError, RemoteCallError
from swarmlm.models.naming import default_dht_prefix
from swarmlm.models.span import SpanModel
from swarmlm.protocol import service
from swarmlm.protocol.bundle import ReplyTensors, SpanTensors
from swarmlm.protocol.codec import encode, read_message
from swarmlm.protocol.messages import InferenceOpen, InferenceStep, ReplyHeader
from swarmlm.server.validation import max_message_bytes
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import running_swarm

NUM_BLOCKS = 5
HIDDEN_SIZE = 64
CACHE_TOKENS = 64  # the server's whole KV-cache budget (at each block: sessions here span all of them)
ALLOC_TIMEOUT_S = 1.0  # how long an open waits for room before "server busy"
IDLE_TIMEOUT_S = 3.0  # a session without steps for this long is closed by the server
# a step on a live server answers within this; anything slower means the client waited for a timeout
REQUEST_TIMEOUT_S = 20.0
# the server computes in float32 like the local span: outputs agree to rounding
ATOL = 1e-4

T = TypeVar("T")


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    extra_args = [
        "--cache-tokens", str(CACHE_TOKENS),
        "--alloc-timeout", str(ALLOC_TIMEOUT_S),
        "--session-idle-timeout", str(IDLE_TIMEOUT_S),
        "--peer-cache-share", "1",  # these tests fill the whole budget from one client
    ]  # fmt: skip
    with running_swarm(tiny_model_dir, [(0, NUM_BLOCKS)], extra_args=extra_args) as swarm:
        yield swarm


class SessionClient:
    """Inference streams to the one server, driven from the test's thread through a client event loop of its own."""

    def __init__(self, swarm: LocalSwarm, model_dir: Path):
        self.peer_id: str = swarm.servers[0].peer_id
        prefix = default_dht_prefix(str(model_dir))
        config = ClientConfig(
            initial_peers=tuple(swarm.initial_peers), dht_prefix=prefix, request_timeout_s=REQUEST_TIMEOUT_S
        )
        self.manager = SequenceManager(config, prefix, NUM_BLOCKS)
        self.loop = LoopThread(name="test-inference-client")
        self.streams: list[SpanStream] = []
        try:
            self.run(self.manager.start())
            self._wait_for_server()
        except BaseException:
            self.shutdown()
            raise

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return self.loop.run(coro, timeout=timeout)

    def _wait_for_server(self, timeout_s: float = 30.0) -> None:
        """ensure_connected dials the server's announced addresses: wait until its record has been read."""
        deadline = time.monotonic() + timeout_s
        while self.peer_id not in self.manager.servers:
            assert time.monotonic() < deadline, "the server's record never appeared in the DHT"
            time.sleep(0.2)
            self.run(self.manager.refresh())

    def stream(self) -> SpanStream:
        """A new stream, closed at the end of the test whatever happens to it."""
        stream = SpanStream(self.manager, self.peer_id, "rpc_inference")
        self.streams.append(stream)
        return stream

    def open(self, batch_size: int, max_length: int, start: int = 0, end: int = NUM_BLOCKS) -> SpanStream:
        stream = self.stream()
        header = InferenceOpen(start_block=start, end_block=end, batch_size=batch_size, max_length=max_length)
        assert self.run(stream.exchange(header, [])).names() == []
        return stream

    def step(
        self,
        stream: SpanStream,
        hidden: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
        start_from_position: int | None = None,
    ) -> torch.Tensor:
        bundle = SpanTensors(hidden, attention_mask=attention_mask, hypo_ids=hypo_ids)
        header = InferenceStep(tensors=bundle.names(), start_from_position=start_from_position)
        reply = self.run(stream.exchange(header, bundle.tensors()))
        assert reply.names() == ["hidden"] and reply.required("hidden").shape == hidden.shape
        return reply.required("hidden")

    def close(self, stream: SpanStream) -> None:
        self.run(stream.close())
        if stream in self.streams:
            self.streams.remove(stream)

    def raw_open(self, header: InferenceOpen) -> ReplyHeader:
        """Send one InferenceOpen and return the server's reply header as it came; then end the stream."""

        async def call() -> ReplyHeader:
            replied = asyncio.Event()

            async def parts() -> AsyncIterator[runtime_pb2.ExpertRequest]:
                for part in encode(header, [], runtime_pb2.ExpertRequest):
                    yield part
                await replied.wait()  # like SpanStream: nothing more is written before the reply has been read

            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                peer = await self.manager.ensure_connected(self.peer_id)
                replies = await service.stub(self.manager.p2p, peer).rpc_inference(parts())
                message = await read_message(replies, ReplyHeader, max_bytes=1 << 20)
                replied.set()
                # a refused stream is already closed, so ending it may fail: only the reply above matters
                with contextlib.suppress(Exception):
                    async for _ in replies:
                        pass
            assert message is not None, "the server ended the stream without a reply"
            return message[0]

        return self.run(call())

    def send_then_read(
        self, messages: list[tuple[InferenceOpen | InferenceStep, list[torch.Tensor]]]
    ) -> list[ReplyHeader]:
        """Write all messages and end the stream; read the replies only once writing has finished (or failed)."""

        async def call() -> list[ReplyHeader]:
            written = asyncio.Event()

            async def parts() -> AsyncIterator[runtime_pb2.ExpertRequest]:
                for header, tensors in messages:
                    for part in encode(header, tensors, runtime_pb2.ExpertRequest):
                        yield part
                written.set()  # every part above has been handed to the transport

            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                peer = await self.manager.ensure_connected(self.peer_id)
                replies = await service.stub(self.manager.p2p, peer).rpc_inference(parts())
                with contextlib.suppress(TimeoutError):  # a write that failed never gets to the end
                    await asyncio.wait_for(written.wait(), timeout=3.0)
                headers = []
                while (message := await read_message(replies, ReplyHeader, max_bytes=1 << 20)) is not None:
                    headers.append(message[0])
            return headers

        return self.run(call())

    def close_all(self) -> None:
        while self.streams:
            self.close(self.streams[-1])

    def shutdown(self) -> None:
        try:
            self.close_all()
            self.run(self.manager.close())
        finally:
            self.loop.close()


@pytest.fixture(scope="module")
def module_client(swarm: LocalSwarm, tiny_model_dir: Path) -> Iterator[SessionClient]:
    client = SessionClient(swarm, tiny_model_dir)
    yield client
    client.shutdown()


@pytest.fixture
def client(module_client: SessionClient) -> Iterator[SessionClient]:
    """The module's client; every stream a test opened is closed after it, so the next test finds an empty cache."""
    yield module_client
    module_client.close_all()


@pytest.fixture(scope="module")
def span(tiny_model_dir: Path) -> SpanModel:
    return SpanModel.from_dir(tiny_model_dir, 0, NUM_BLOCKS)


def hidden_states(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, seq, HIDDEN_SIZE, generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a - b).abs().max().item()


def timed(call: Callable[..., T], *args: object) -> tuple[T, float]:
    began = time.monotonic()
    result = call(*args)
    return result, time.monotonic() - began


def test_cache_budget_refuses_when_full_and_frees_on_close(client: SessionClient) -> None:
    full = client.open(1, CACHE_TOKENS)
    client.step(full, hidden_states(1, 1, seed=0))

    # a second session finds no room: after waiting the alloc timeout, "busy" (another server may have room)
    began = time.monotonic()
    with pytest.raises(RemoteCallError, match="server busy") as refused:
        client.open(1, 8)
    waited = time.monotonic() - began
    assert not isinstance(refused.value, BadRequestError)
    assert ALLOC_TIMEOUT_S * 0.9 <= waited < ALLOC_TIMEOUT_S + 5, f"refused after {waited:.2f} s"
    reply, waited = timed(
        client.raw_open, InferenceOpen(start_block=0, end_block=NUM_BLOCKS, batch_size=1, max_length=8)
    )
    assert not reply.ok and reply.error_kind == "busy" and "server busy" in reply.error
    assert waited >= ALLOC_TIMEOUT_S * 0.9

    client.close(full)
    second = client.open(1, 8)
    client.step(second, hidden_states(1, 2, seed=1))
    client.close(second)
    # the refused opens reserved nothing
    client.open(1, CACHE_TOKENS)


def test_open_waiting_for_room_gets_it_when_a_session_closes(client: SessionClient) -> None:
    full = client.open(1, CACHE_TOKENS)
    waiting = client.stream()
    header = InferenceOpen(start_block=0, end_block=NUM_BLOCKS, batch_size=1, max_length=8)

    async def open_while_the_other_closes() -> ReplyTensors:
        opening = asyncio.create_task(waiting.exchange(header, []))
        await asyncio.sleep(ALLOC_TIMEOUT_S / 4)
        assert not opening.done(), "the open did not wait for room"
        await full.close()
        return await opening

    assert client.run(open_while_the_other_closes()).names() == []
    client.streams.remove(full)
    client.step(waiting, hidden_states(1, 3, seed=2))


def test_session_larger_than_the_whole_cache_is_refused_at_once(client: SessionClient) -> None:
    # 2 * 40 = 80 tokens > 64 (at each block): no wait can help; max_length itself is within the model's context
    began = time.monotonic()
    with pytest.raises(RemoteCallError, match="exceeds this server's cache") as refused:
        client.open(2, 40)
    assert not isinstance(refused.value, BadRequestError)
    assert time.monotonic() - began < ALLOC_TIMEOUT_S
    reply = client.raw_open(InferenceOpen(start_block=0, end_block=NUM_BLOCKS, batch_size=2, max_length=40))
    assert not reply.ok and reply.error_kind == "too_large"
    assert f"of {CACHE_TOKENS * NUM_BLOCKS} block-tokens" in reply.error  # CACHE_TOKENS at each of the blocks
    # the refusal reserved nothing
    client.open(1, CACHE_TOKENS)


def test_idle_session_expires_and_frees_its_cache(client: SessionClient) -> None:
    idle = client.open(1, CACHE_TOKENS)
    client.step(idle, hidden_states(1, 4, seed=3))
    time.sleep(IDLE_TIMEOUT_S + 0.5)

    # the expired session's tokens are free again: a full-budget session fits without waiting for the alloc timeout
    fresh, waited = timed(client.open, 1, CACHE_TOKENS)
    assert waited < ALLOC_TIMEOUT_S, f"open waited {waited:.2f} s for the expired session's tokens"
    client.step(fresh, hidden_states(1, 1, seed=4))

    # the server ended the expired stream: a step on it fails as a failure of this server, promptly
    began = time.monotonic()
    with pytest.raises(RemoteCallError) as failed:
        client.step(idle, hidden_states(1, 1, seed=5))
    took = time.monotonic() - began
    assert not isinstance(failed.value, BadRequestError)
    assert "timed out" not in str(failed.value), (
        f"the client noticed the closed stream only by timeout: {failed.value}"
    )
    assert took < REQUEST_TIMEOUT_S / 2, f"the step on the expired stream took {took:.1f} s to fail"


def test_a_hundred_sessions_leave_the_cache_empty(client: SessionClient) -> None:
    token = hidden_states(1, 1, seed=6)
    for _ in range(100):
        stream = client.open(1, 16)
        client.step(stream, token)
        client.close(stream)
    full, waited = timed(client.open, 1, CACHE_TOKENS)
    assert waited < ALLOC_TIMEOUT_S, f"a full-budget open waited {waited:.2f} s after 100 closed sessions"
    client.step(full, token)


def test_bad_steps_get_clear_errors_and_the_session_goes_on(client: SessionClient, span: SpanModel) -> None:
    stream = client.open(1, 8)
    cache = DynamicCache()
    seed = iter(range(100, 200))

    def good_step(seq: int, attention_mask: torch.Tensor | None = None) -> None:
        hidden = hidden_states(1, seq, seed=next(seed))
        out = client.step(stream, hidden, attention_mask=attention_mask)
        with torch.inference_mode():
            expected = span(hidden, cache=cache, attention_mask=attention_mask)
        assert max_diff(out, expected) <= ATOL

    def bad_step(message: str, hidden: torch.Tensor, **extras: torch.Tensor) -> None:
        with pytest.raises(BadRequestError, match=message):
            client.step(stream, hidden, **extras)

    bad_step("to 9 tokens, beyond its max_length of 8", hidden_states(1, 9, seed=0))
    good_step(2)
    bad_step("hidden size 63", torch.randn(1, 1, 63))
    good_step(1)
    bad_step("batch 2; the session was opened for batch 1", hidden_states(2, 1, seed=0))
    good_step(1)
    bad_step(r"hypo_ids must lie in \[0, 1\)", hidden_states(1, 1, seed=0), hypo_ids=torch.tensor([1]))
    good_step(1)
    # the mask covers past + new tokens (5 + 1), not the new ones only
    short_mask = torch.ones(1, 1, dtype=torch.int64)
    bad_step(r"attention_mask must have shape \(1, 6\)", hidden_states(1, 1, seed=0), attention_mask=short_mask)
    good_step(1, attention_mask=torch.ones(1, 6, dtype=torch.int64))
    assert cache.get_seq_length(0) == 6
    bad_step("to 9 tokens, beyond its max_length of 8", hidden_states(1, 3, seed=0))
    good_step(2)  # exactly max_length


# the most float32 tokens one step message may carry (the server's default --max-tokens-per-request is 8192)
STEP_LIMIT_TOKENS = max_message_bytes(8192, HIDDEN_SIZE) // (HIDDEN_SIZE * 4)
REFUSED_WHILE_WRITING = {
    # the server reads the open, then stops inside the step at its size limit, 6 MiB before the step's end
    "step over the size limit": (
        [InferenceOpen(start_block=0, end_block=NUM_BLOCKS, batch_size=1, max_length=8), InferenceStep()],
        STEP_LIMIT_TOKENS * 3 // 2,
        ["ok", "bytes of tensors"],
    ),
    # the server stops at the first header, which is not an open: the step's 8 MiB of hidden states still follow
    "step before open": ([InferenceStep()], 32768, ["malformed InferenceOpen"]),
}


@pytest.mark.parametrize("case", list(REFUSED_WHILE_WRITING))
def test_a_refused_message_still_gets_its_reply_while_the_client_is_writing(client: SessionClient, case: str) -> None:
    """The server stops reading a message it refuses, answers bad_request and ends the stream; the client may still
    be writing the rest of that message then. Its answer must reach the client anyway (rpc_forward's handler drains
    the request before closing for this reason), not be lost to a broken pipe that reads as a failure of the server,
    after which a client bans a healthy server and replays the same bad request elsewhere."""
    headers, tokens, expected = REFUSED_WHILE_WRITING[case]
    hidden = torch.zeros(1, tokens, HIDDEN_SIZE)
    messages = [(header, [hidden] if isinstance(header, InferenceStep) else []) for header in headers]
    try:
        replies = client.send_then_read(messages)
    except Exception as e:  # noqa: BLE001 - the failure is the finding: show it in the assertion below
        replies = [f"no reply, the stream broke: {type(e).__name__}: {e}"]
    summary = [reply if isinstance(reply, str) else reply.error or "ok" for reply in replies]
    assert len(summary) == len(expected) and all(want in got for want, got in zip(expected, summary, strict=True)), (
        f"{case}: expected replies {expected}, got {summary}"
    )
    assert replies[-1].error_kind == "bad_request"
    # the refused stream freed what it had reserved
    client.open(1, CACHE_TOKENS)


def test_a_step_before_open_is_a_bad_request(client: SessionClient) -> None:
    with pytest.raises(BadRequestError, match="malformed InferenceOpen") as refused:
        client.run(client.stream().exchange(InferenceStep(), [hidden_states(1, 1, seed=0)]))
    assert "kind" in str(refused.value)


def test_blocks_outside_the_span_are_not_served(client: SessionClient) -> None:
    # another server may serve them (the client's view of this one was out of date): the client re-routes
    with pytest.raises(RerouteError, match="not served here") as refused:
        client.open(1, 8, start=3, end=7)
    assert refused.value.kind == "not_served"
    reply = client.raw_open(InferenceOpen(start_block=3, end_block=7, batch_size=1, max_length=8))
    assert not reply.ok and reply.error_kind == "not_served" and "blocks 3:7 are not served here" in reply.error
    with pytest.raises(BadRequestError, match="exceeds the model's context"):
        client.open(1, 257)


@pytest.mark.parametrize("blocks", [(0, NUM_BLOCKS), (1, 4)], ids=["all-blocks", "middle-blocks"])
def test_cached_decoding_equals_full_recompute(
    client: SessionClient, span: SpanModel, blocks: tuple[int, int]
) -> None:
    start, end = blocks
    hidden = hidden_states(1, 10, seed=7)
    stream = client.open(1, 10, start=start, end=end)
    for begin, stop in [(0, 7), (7, 8), (8, 9), (9, 10)]:
        out = client.step(stream, hidden[:, begin:stop])
        with torch.inference_mode():
            expected = span(hidden[:, :stop], start=start, end=end)[:, begin:stop]
        assert max_diff(out, expected) <= ATOL, f"tokens {begin}:{stop}"


def test_empty_steps_are_no_ops_and_a_rollback_recomputes_from_the_cut(client: SessionClient, span: SpanModel) -> None:
    hidden = hidden_states(1, 8, seed=9)
    stream = client.open(1, 8)
    client.step(stream, hidden[:, :5])
    assert client.step(stream, hidden[:, :0]).shape == (1, 0, HIDDEN_SIZE)  # nothing new: nothing computed
    # rewind to 3 tokens (as speculative decoding does when 2 drafted tokens are rejected), then go on differently
    other = hidden_states(1, 3, seed=10)
    out = client.step(stream, other, start_from_position=3)
    with torch.inference_mode():
        expected = span(torch.cat([hidden[:, :3], other], dim=1))[:, 3:]
    assert max_diff(out, expected) <= ATOL
    assert client.step(stream, hidden[:, :0], start_from_position=6).shape[1] == 0  # an empty step may only rewind
    with pytest.raises(BadRequestError, match="beyond the 6 tokens"):
        client.step(stream, hidden[:, :1], start_from_position=7)


def test_server_survives_every_session(client: SessionClient, swarm: LocalSwarm) -> None:
    server = swarm.servers[0]
    assert server.process.poll() is None, server.log_tail()
    client.step(client.open(1, CACHE_TOKENS), hidden_states(1, 5, seed=8))
    # every refusal above was an answer, not a crash of the handler
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "Handler failed" not in log, server.log_tail(60)
