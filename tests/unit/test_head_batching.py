"""The client's LM head batcher: concurrent callers share one product and each gets exactly its own rows."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest
import torch

from swarmlm.client import head_batching
from swarmlm.client.head_batching import HeadBatcher, LoopHeadBatcher


class SlowHead(torch.nn.Linear):
    """A head that takes a while, so callers pile up behind it; it counts the rows of each call."""

    def __init__(self) -> None:
        super().__init__(8, 50, bias=False)
        self.calls: list[int] = []

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[0])
        time.sleep(0.05)
        return super().forward(hidden)


def call_together(batcher: HeadBatcher, head, inputs: list[torch.Tensor], stagger_s: float = 0.0) -> list[object]:
    """Each input from its own thread, all at once (or the i-th stagger_s * i later)."""
    results: list[object] = [None] * len(inputs)
    go = threading.Barrier(len(inputs))

    def work(i: int) -> None:
        go.wait()
        time.sleep(stagger_s * i)
        try:
            results[i] = batcher(head, inputs[i])
        except Exception as e:  # noqa: BLE001 - the test looks at what each caller got
            results[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_concurrent_callers_share_products_and_get_their_own_rows() -> None:
    torch.manual_seed(0)
    head, batcher = SlowHead(), HeadBatcher()
    inputs = [torch.randn(1, 1, 8) for _ in range(6)] + [torch.randn(2, 3, 8)]
    results = call_together(batcher, head, inputs)
    with torch.no_grad():
        for hidden, result in zip(inputs, results, strict=True):
            assert isinstance(result, torch.Tensor) and result.shape == (*hidden.shape[:-1], 50)
            torch.testing.assert_close(result, torch.nn.functional.linear(hidden, head.weight), rtol=1e-5, atol=1e-6)
    # 7 callers and 12 rows, in fewer products than callers: those that waited ran together
    assert sum(head.calls) == 12 and len(head.calls) < len(inputs)
    assert batcher.rows == 12 and batcher.batches == len(head.calls)


def test_a_failing_product_fails_every_caller_in_it_and_the_next_ones_still_run() -> None:
    batcher = HeadBatcher()

    def broken(hidden: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        raise ValueError("head failed")

    results = call_together(batcher, broken, [torch.randn(1, 1, 8) for _ in range(4)])
    assert all(isinstance(r, ValueError) for r in results)
    head = SlowHead()
    assert batcher(head, torch.randn(1, 1, 8)).shape == (1, 1, 50)


def test_callers_of_different_heads_are_not_mixed() -> None:
    first, second, batcher = SlowHead(), SlowHead(), HeadBatcher()
    inputs = [torch.randn(1, 1, 8) for _ in range(6)]
    heads = [first, second] * 3
    results: list[object] = [None] * 6
    go = threading.Barrier(6)

    def work(i: int) -> None:
        go.wait()
        results[i] = batcher(heads[i], inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    with torch.no_grad():
        for head, hidden, result in zip(heads, inputs, results, strict=True):
            torch.testing.assert_close(result, torch.nn.functional.linear(hidden, head.weight))
    assert sum(first.calls) == 3 and sum(second.calls) == 3


@pytest.mark.parametrize("rows", [1, 5])
def test_one_caller_alone_runs_at_once(rows: int) -> None:
    head, batcher = SlowHead(), HeadBatcher()
    hidden = torch.randn(rows, 1, 8)
    with torch.no_grad():
        torch.testing.assert_close(batcher(head, hidden), head(hidden))
    assert head.calls == [rows, rows]


def test_a_cohort_arriving_a_little_apart_shares_one_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generations that use the head together wait briefly for each other's rows (the last server answers a cohort
    at once, but its rows reach their threads apart); the wait is widened here so a loaded machine cannot miss it."""
    monkeypatch.setattr(head_batching, "GATHER_GAP_S", 0.5)
    monkeypatch.setattr(head_batching, "GATHER_MAX_S", 2.0)
    monkeypatch.setattr(head_batching, "ACTIVE_S", 60.0)
    head, batcher = torch.nn.Linear(8, 50, bias=False), HeadBatcher()
    inputs = [torch.randn(1, 1, 8) for _ in range(4)]
    for _ in range(3):  # the first round makes the four threads known as active generations
        batches = batcher.batches
        results = call_together(batcher, head, inputs, stagger_s=0.02)
        with torch.no_grad():
            for hidden, result in zip(inputs, results, strict=True):
                torch.testing.assert_close(result, torch.nn.functional.linear(hidden, head.weight))
    assert batcher.batches == batches + 1  # the last round's four rows ran as one product


def test_a_generation_alone_does_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_batching, "GATHER_GAP_S", 5.0)
    monkeypatch.setattr(head_batching, "GATHER_MAX_S", 5.0)
    head, batcher = torch.nn.Linear(8, 50, bias=False), HeadBatcher()
    began = time.monotonic()
    for _ in range(5):
        batcher(head, torch.randn(1, 1, 8))
    assert time.monotonic() - began < 2.0


class ManualClock:
    """A clock a test sets by hand: the batcher's timing rules are checked at chosen times, with no waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_generation_that_stopped_calling_no_longer_holds_back_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """Callers seen within ACTIVE_S are a cohort: the next caller waits (up to GATHER_MAX_S) for their rows; one
    unseen for ACTIVE_S (a finished generation) is not waited for."""
    monkeypatch.setattr(head_batching, "GATHER_GAP_S", 30.0)  # a wait for a cohort would show as seconds
    monkeypatch.setattr(head_batching, "GATHER_MAX_S", 30.0)
    clock, head = ManualClock(), torch.nn.Linear(8, 50, bias=False)
    batcher = HeadBatcher(clock=clock)
    calls: queue.Queue[float] = queue.Queue()  # the other generation's thread calls the head after each delay

    def other_generation() -> None:
        while (delay_s := calls.get()) >= 0:
            time.sleep(delay_s)
            batcher(head, torch.randn(1, 1, 8))
            calls.task_done()

    other = threading.Thread(target=other_generation, daemon=True)
    other.start()
    calls.put(0.0)  # the other generation calls the head
    calls.join()
    batches = batcher.batches
    calls.put(0.2)  # and calls again a moment after this one: this caller waits for its rows
    batcher(head, torch.randn(1, 1, 8))
    calls.join()
    assert batcher.batches == batches + 1  # both rows went as one product
    clock.now += head_batching.ACTIVE_S + 0.01  # the other generation has not called for ACTIVE_S: it is gone
    began = time.monotonic()
    batcher(head, torch.randn(1, 1, 8))
    assert time.monotonic() - began < 5.0  # not held for the gone generation's rows
    calls.put(-1)
    other.join(timeout=30)


def test_products_use_the_packed_weight_and_follow_its_changes() -> None:
    torch.manual_seed(0)
    head, batcher = torch.nn.Linear(64, 300, bias=True), HeadBatcher()
    with torch.no_grad():
        for rows in (1, 3, 6):  # a lone decode step's row, a few, more than the packing's hint
            hidden = torch.randn(rows, 1, 64)
            torch.testing.assert_close(batcher(head, hidden), head(hidden), rtol=1e-5, atol=1e-5)
            if head_batching.packable(head.weight):  # where MKL packs, this product went through the packed copy
                weight, _, _, packed = batcher._packed[id(head)]
                assert weight is head.weight and packed is not None
            head.weight.mul_(-2.0)  # changed in place: the packed copy is stale and must be remade
            torch.testing.assert_close(batcher(head, hidden), head(hidden), rtol=1e-5, atol=1e-5)
            head.weight = torch.nn.Parameter(torch.randn(300, 64), requires_grad=False)  # replaced
            torch.testing.assert_close(batcher(head, hidden), head(hidden), rtol=1e-5, atol=1e-5)
        many = torch.randn(20, 1, 64)  # more rows than the rows kernel takes
        torch.testing.assert_close(batcher(head, many), head(many), rtol=1e-5, atol=1e-5)


class GatedHead:
    """A product (rows, 8) -> (rows, 50) that waits for `gate` and records the rows of each call."""

    def __init__(self) -> None:
        self.weight = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
        self.calls: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        self.gate.wait(30)
        self.calls.append(rows.shape[0])
        if self.fail:
            raise RuntimeError("the product broke")
        return rows @ self.weight.T


def rows_of(seed: int, count: int = 1) -> torch.Tensor:
    return torch.randn(count, 8, generator=torch.Generator().manual_seed(seed))


def test_on_a_loop_rows_of_generations_still_stepping_are_gathered_into_one_product() -> None:
    head = GatedHead()
    batcher = LoopHeadBatcher(head)

    async def cohort() -> list[torch.Tensor]:
        batcher.stepping = 3  # three more generations are still at the servers: the first rows wait for theirs
        return await asyncio.gather(*(batcher(rows_of(seed, seed)) for seed in (1, 2, 3, 4)))

    outputs = asyncio.run(cohort())
    assert head.calls == [10]
    for seed, out in zip((1, 2, 3, 4), outputs, strict=True):
        torch.testing.assert_close(out, rows_of(seed, seed) @ head.weight.T)
    assert (batcher.batches, batcher.rows) == (1, 10)
    batcher.close()


def test_on_a_loop_a_generation_alone_goes_at_once_and_rows_arriving_meanwhile_go_next_together() -> None:
    head = GatedHead()
    batcher = LoopHeadBatcher(head)

    async def run() -> list[torch.Tensor]:
        head.gate.clear()
        first = asyncio.ensure_future(batcher(rows_of(1)))  # no generation stepping: its product starts at once
        while not head.calls and not batcher._running:
            await asyncio.sleep(0)
        later = [asyncio.ensure_future(batcher(rows_of(seed))) for seed in (2, 3)]
        await asyncio.sleep(0.05)
        assert not first.done()
        head.gate.set()
        return [await first, *[await task for task in later]]

    outputs = asyncio.run(run())
    assert head.calls == [1, 2]
    for seed, out in zip((1, 2, 3), outputs, strict=True):
        torch.testing.assert_close(out, rows_of(seed) @ head.weight.T)
    batcher.close()


def test_on_a_loop_a_failing_product_fails_its_callers_and_a_cancelled_caller_leaves_the_rest() -> None:
    head = GatedHead()
    batcher = LoopHeadBatcher(head)

    async def run() -> None:
        head.fail = True
        results = await asyncio.gather(batcher(rows_of(1)), batcher(rows_of(2)), return_exceptions=True)
        assert [str(r) for r in results] == ["the product broke"] * 2
        head.fail = False
        head.gate.clear()
        gone = asyncio.ensure_future(batcher(rows_of(3)))
        kept = asyncio.ensure_future(batcher(rows_of(4)))
        await asyncio.sleep(0.01)
        gone.cancel()
        head.gate.set()
        torch.testing.assert_close(await kept, rows_of(4) @ head.weight.T)
        torch.testing.assert_close(await batcher(rows_of(5)), rows_of(5) @ head.weight.T)

    asyncio.run(run())
    batcher.close()
