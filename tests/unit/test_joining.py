"""Forward and backward requests joined along the batch dimension: each gets what it would get alone."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import pytest
import torch

from swarmlm.models.span import SpanModel
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.server.backend import SpanBackend, SpanWork, StepWork, whole
from swarmlm.server.joining import JoinableRequest, can_join
from swarmlm.server.scheduler import BatchLimits, Kind, next_batch
from tests.unit.test_scheduler import hold, task

HIDDEN = 64
# fp32: a request's results joined with others equal its results alone this closely
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> SpanBackend:
    return SpanBackend(SpanModel.from_dir(tiny_model_dir, 0, 5), torch.float32, "cpu", 8192)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def requests(kind: str, seq: int = 6) -> list[SpanTensors]:
    """Three requests of 1, 2 and 3 rows; prompts shared by a request's rows, per row, and none (when joined, a
    request without prompts cannot meet one with them: each list is one kind of prompt use)."""
    out = []
    for index, rows in enumerate((1, 2, 3)):
        grad = randn(rows, seq, HIDDEN, seed=50 + index) if kind.startswith("backward") else None
        mask = torch.ones(rows, seq, dtype=torch.int64)
        mask[0, :2] = 0  # left padding in the first row
        prompts = None
        if kind.endswith("shared"):
            prompts = randn(5, 3, HIDDEN, seed=70 + index)
        elif kind.endswith("per_row"):
            prompts = randn(5, rows, 3, HIDDEN, seed=80 + index)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out.append(SpanTensors(randn(rows, seq, HIDDEN, seed=index), grad_outputs=grad, attention_mask=mask,
                               position_ids=positions, prompts=prompts))  # fmt: skip
    return out


@pytest.mark.parametrize(("kind", "names"), [("forward", ["hidden"]), ("backward", ["grad_hidden"]),
                                             ("backward_shared", ["grad_hidden", "grad_prompts"])])  # fmt: skip
def test_a_work_item_runs_to_its_reply_named(backend: SpanBackend, kind: str, names: list[str]) -> None:
    """The executor runs a work item (data: what, over which blocks, with which tensors) to its reply, named for
    what the request sent; the tensors are those of the computation's own results."""
    inputs = requests(kind)[1]
    reply, _ = whole(backend.execute(SpanWork(0, 5, inputs)))
    assert reply.names() == names
    alone, _ = backend._run(0, 5, inputs)
    assert all(torch.equal(got, own) for got, own in zip(reply.tensors(), alone, strict=True))
    from swarmlm.models.growing_cache import GrowingCache

    step = StepWork(GrowingCache(), 0, 5, SpanTensors(inputs.hidden), chunk_tokens=1024)
    stepped, _ = whole(backend.execute(step))
    assert stepped.names() == ["hidden"] and step.cache.get_seq_length(0) == inputs.hidden.shape[1]


@pytest.mark.parametrize("kind", ["forward", "forward_shared", "backward", "backward_shared", "backward_per_row"])
def test_joined_requests_get_what_they_would_get_alone(backend: SpanBackend, kind: str) -> None:
    inputs = requests(kind)
    alone = [backend._run(0, 5, request)[0] for request in inputs]
    joined_run = backend._run_joined([JoinableRequest(0, 5, request) for request in inputs])
    try:
        while True:
            next(joined_run)
    except StopIteration as done:
        joined = [reply.tensors() for reply, _ in done.value]  # named: in wire order
    for own, together, request in zip(alone, joined, inputs, strict=True):
        assert [t.shape for t in together] == [t.shape for t in own]
        if request.prompts is not None and kind.startswith("backward"):
            assert together[1].shape == request.prompts.shape  # the prompts' gradient in the shape they came in
        for a, b in zip(own, together, strict=True):
            assert (a - b).abs().max().item() <= TOLERANCE * max(1.0, a.abs().max().item())


def test_only_requests_alike_but_for_their_batch_size_join() -> None:
    base = SpanTensors(torch.zeros(2, 6, HIDDEN))
    same = JoinableRequest(0, 5, SpanTensors(torch.zeros(3, 6, HIDDEN)))
    assert can_join(JoinableRequest(0, 5, base), same)
    for other in (
        JoinableRequest(0, 4, SpanTensors(torch.zeros(3, 6, HIDDEN))),  # other blocks
        JoinableRequest(0, 5, SpanTensors(torch.zeros(3, 7, HIDDEN))),  # other length
        JoinableRequest(0, 5, SpanTensors(torch.zeros(3, 6, HIDDEN, dtype=torch.bfloat16))),  # other dtype
        JoinableRequest(0, 5, SpanTensors(torch.zeros(3, 6, HIDDEN), attention_mask=torch.ones(3, 6))),  # a mask
        JoinableRequest(0, 5, SpanTensors(torch.zeros(3, 6, HIDDEN), prompts=torch.zeros(5, 2, HIDDEN))),  # prompts
    ):
        assert not can_join(JoinableRequest(0, 5, base), other)
    shared, per_row = torch.zeros(5, 2, HIDDEN), torch.zeros(5, 3, 2, HIDDEN)
    assert can_join(JoinableRequest(0, 5, SpanTensors(torch.zeros(2, 6, HIDDEN), prompts=shared)),
                    JoinableRequest(0, 5, SpanTensors(torch.zeros(3, 6, HIDDEN), prompts=per_row)))  # fmt: skip


def test_waiting_requests_join_within_the_token_budget() -> None:
    limits = BatchLimits(max_join_tokens=25, max_join_requests=3)

    def joinable(seq: int, rows: int = 1, blocks: tuple[int, int] = (0, 5)) -> JoinableRequest:
        return JoinableRequest(*blocks, SpanTensors(torch.zeros(rows, seq, HIDDEN)))

    queue = [task(Kind.FORWARD, p, i) for i, p in enumerate("abcdef")]
    joins = [joinable(10), joinable(10, blocks=(0, 4)), joinable(7), joinable(10, rows=2), joinable(10), joinable(10)]
    for queued, join in zip(queue, joins, strict=True):
        queued.join = join
    # a: 10 tokens; b other blocks; c other length; d's 20 tokens would pass the budget; e fits; f would pass it
    assert [t.seq for t in next_batch(queue, limits, {})] == [0, 4]
    assert [t.seq for t in next_batch(queue, BatchLimits(max_join_requests=2), {})] == [0, 3]
    queue.append(task(Kind.INFERENCE, "g", 6))  # more urgent work goes first, alone
    assert [t.seq for t in next_batch(queue, limits, {})] == [6]


def test_joined_requests_of_different_peers_run_once_and_get_their_own_results(backend: SpanBackend) -> None:
    inputs = requests("forward")
    release = threading.Event()

    async def main() -> list[torch.Tensor]:
        blocker = asyncio.ensure_future(hold(backend.scheduler, release))
        await asyncio.sleep(0.05)  # the compute thread is busy: the requests below wait together
        runs = [asyncio.ensure_future(backend.run(0, 5, request, peer=f"p{i}")) for i, request in enumerate(inputs)]
        await asyncio.sleep(0.05)
        release.set()
        await blocker
        return [reply.required("hidden") for reply, _ in await asyncio.gather(*runs)]

    before = backend.scheduler.joined_runs
    results = asyncio.run(main())
    assert backend.scheduler.joined_runs == before + 1 and backend.scheduler.joined_requests >= 3
    for request, outputs in zip(inputs, results, strict=True):
        alone = backend._run(0, 5, request)[0]
        assert (outputs - alone[0]).abs().max().item() <= TOLERANCE


def test_fresh_sessions_prompts_waiting_together_run_as_one_forward(backend: SpanBackend) -> None:
    """Inference steps carrying the prompts of fresh sessions, queued while the compute thread is busy, run as one
    forward; each session gets its own outputs and cache, as its prompt alone gives them."""
    from swarmlm.models.growing_cache import GrowingCache

    prompts = [SpanTensors(randn(1, length, HIDDEN, seed=40 + length)) for length in (4, 7, 5)]
    caches = [GrowingCache() for _ in prompts]
    release = threading.Event()

    async def main() -> list[torch.Tensor]:
        blocker = asyncio.ensure_future(hold(backend.scheduler, release))
        await asyncio.sleep(0.05)
        steps = [
            asyncio.ensure_future(backend.step(cache, 1, 4, prompt, 1024, peer=f"p{i}"))
            for i, (cache, prompt) in enumerate(zip(caches, prompts, strict=True))
        ]
        await asyncio.sleep(0.05)
        release.set()
        await blocker
        return [reply.required("hidden") for reply, _ in await asyncio.gather(*steps)]

    before = backend.scheduler.joined_prompts
    results = asyncio.run(main())
    assert backend.scheduler.joined_prompts == before + 1 and backend.scheduler.joined_prompt_sessions >= 3
    for prompt, cache, got in zip(prompts, caches, results, strict=True):
        alone_cache = GrowingCache()
        alone = whole(backend._step(alone_cache, 1, 4, prompt, 1024, None))[0][0]
        assert got.shape == alone.shape and (got - alone).abs().max().item() <= TOLERANCE
        assert cache.get_seq_length(1) == alone_cache.get_seq_length(1) == prompt.hidden.shape[1]


def test_a_long_prompt_runs_in_quanta_between_other_sessions_steps(backend: SpanBackend) -> None:
    """A long prompt is long work: while a session decodes here it runs in quanta (16 tokens here), the
    session's steps run in between (not after the whole prompt), and its outputs and cache are what one run of it
    gives."""
    from swarmlm.models.growing_cache import GrowingCache

    prompt = SpanTensors(randn(1, 240, HIDDEN, seed=7))  # 15 quanta of 16 tokens
    expected_cache, alone_cache = GrowingCache(), GrowingCache()
    quantum = backend.scheduler.limits.quantum_tokens
    order: list[str] = []

    async def main() -> tuple[torch.Tensor, torch.Tensor]:
        whole_prompt = await backend.step(expected_cache, 0, 5, prompt, 1024, peer="alone")
        session = GrowingCache()
        await backend.step(session, 0, 5, SpanTensors(randn(1, 3, HIDDEN, seed=8)), 1024, peer="user")

        async def decode(i: int) -> None:
            await backend.step(session, 0, 5, SpanTensors(randn(1, 1, HIDDEN, seed=9 + i)), 1024, peer="user")
            order.append("decode")

        async def long_prompt() -> torch.Tensor:
            reply, _ = await backend.step(alone_cache, 0, 5, prompt, 1024, peer="flood")
            order.append("prompt")
            return reply.required("hidden")

        flood = asyncio.ensure_future(long_prompt())
        for i in range(3):
            await decode(i)
        return whole_prompt[0].required("hidden"), await flood

    limits = backend.scheduler.limits
    backend.scheduler.limits = dataclasses.replace(limits, quantum_tokens=16)
    try:
        expected, chunked = asyncio.run(main())
    finally:
        backend.scheduler.limits = limits
    assert quantum > 0
    assert order[:3] == ["decode"] * 3  # each decode step ran after at most a quantum of the prompt, not after it
    assert (chunked - expected).abs().max().item() < TOLERANCE
    assert expected_cache.get_seq_length(0) == alone_cache.get_seq_length(0) == 240
