"""The server's scheduler: class priorities, fair share between peers, batch formation, and the timing of decode
cohorts, decided under a fake clock; a few runs of the async executor. No sockets."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers.cache_utils import DynamicCache

from swarmlm.server.scheduler import BatchLimits, DecodeStep, Kind, Scheduler, Task, next_batch
from swarmlm.server.scheduling import LONG_KINDS, LONG_TURNS, Decision, SchedulerState, schedule

LIMITS = BatchLimits(max_sessions=3, max_rows=4)


def task(kind: Kind, peer: str, seq: int, decode: DecodeStep | None = None) -> Task:
    return Task(kind, peer, seq, decode=decode)


def decode(start: int = 0, end: int = 5, rows: int = 1, cache: DynamicCache | None = None) -> DecodeStep:
    return DecodeStep(start, end, torch.zeros(rows, 1, 8), cache if cache is not None else DynamicCache())


def call(run: Callable[[], object]) -> object:
    """The executor of the schedulers below, whose items are plain functions (their scheduling is what is tested)."""
    return run()


async def hold(scheduler: Scheduler, release: threading.Event) -> None:
    """A forward holding `scheduler`'s compute thread until `release` is set (a busy server): its item, which the
    scheduler's own executor does not know, runs by a wrapper handing every other item on to that executor."""
    execute, holding = scheduler.execute, object()
    scheduler.execute = lambda item: release.wait(10) if item is holding else execute(item)
    try:
        await scheduler.submit(Kind.FORWARD, "busy", holding)
    finally:
        scheduler.execute = execute


def seqs(batch: list[Task]) -> list[int]:
    return [t.seq for t in batch]


def test_empty_queue_gives_nothing() -> None:
    assert next_batch([], LIMITS, {}) == []


def test_inference_before_forward_before_backward() -> None:
    queue = [task(Kind.BACKWARD, "a", 1), task(Kind.FORWARD, "b", 2), task(Kind.INFERENCE, "c", 3)]
    assert seqs(next_batch(queue, LIMITS, {})) == [3]
    assert seqs(next_batch(queue[:2], LIMITS, {})) == [2]
    assert seqs(next_batch(queue[:1], LIMITS, {})) == [1]


def test_arrival_order_within_a_peer() -> None:
    queue = [task(Kind.FORWARD, "a", 5), task(Kind.FORWARD, "a", 2), task(Kind.FORWARD, "a", 9)]
    assert seqs(next_batch(queue, LIMITS, {})) == [2]


def test_round_robin_between_peers() -> None:
    """One peer's many queued batches do not starve another peer that arrived later."""
    queue = [task(Kind.FORWARD, "greedy", i) for i in range(10)] + [task(Kind.FORWARD, "other", 10)]
    served: dict[str, int] = {}
    order = []
    for turn in range(4):
        (chosen,) = next_batch(queue, LIMITS, served)
        queue.remove(chosen)
        served[chosen.peer] = turn
        order.append(chosen.peer)
    assert order == ["greedy", "other", "greedy", "greedy"]


def test_peer_served_least_recently_goes_first() -> None:
    queue = [task(Kind.INFERENCE, "a", 1), task(Kind.INFERENCE, "b", 2)]
    assert seqs(next_batch(queue, LIMITS, {"a": 7, "b": 3})) == [2]
    assert seqs(next_batch(queue, LIMITS, {"b": 3})) == [1]  # never served: first


def test_decode_steps_over_the_same_blocks_form_one_batch() -> None:
    queue = [
        task(Kind.INFERENCE, "a", 1, decode()),
        task(Kind.INFERENCE, "b", 2, decode(0, 3)),  # other blocks
        task(Kind.INFERENCE, "c", 3),  # not a plain decode step: runs alone
        task(Kind.INFERENCE, "d", 4, decode()),
        task(Kind.FORWARD, "e", 5),
    ]
    assert seqs(next_batch(queue, LIMITS, {})) == [1, 4]


def test_only_steps_with_the_same_adapter_share_a_forward() -> None:
    with_adapter = DecodeStep(0, 5, torch.zeros(1, 1, 8), DynamicCache(), "sql")
    other_adapter = DecodeStep(0, 5, torch.zeros(1, 1, 8), DynamicCache(), "chat")
    queue = [
        task(Kind.INFERENCE, "a", 1, decode()),
        task(Kind.INFERENCE, "b", 2, with_adapter),
        task(Kind.INFERENCE, "c", 3, decode()),
        task(Kind.INFERENCE, "d", 4, other_adapter),
    ]
    assert seqs(next_batch(queue, LIMITS, {})) == [1, 3]
    assert seqs(next_batch(queue[1:], LIMITS, {})) == [2]


def test_a_lone_step_heads_its_own_batch() -> None:
    queue = [task(Kind.INFERENCE, "c", 1), task(Kind.INFERENCE, "d", 2, decode())]
    assert seqs(next_batch(queue, LIMITS, {})) == [1]


def test_batch_limits_on_sessions_and_rows() -> None:
    queue = [task(Kind.INFERENCE, p, i, decode()) for i, p in enumerate("abcde")]
    assert seqs(next_batch(queue, LIMITS, {})) == [0, 1, 2]  # max_sessions
    queue = [task(Kind.INFERENCE, "a", 0, decode(rows=3)), task(Kind.INFERENCE, "b", 1, decode(rows=2)),
             task(Kind.INFERENCE, "c", 2, decode(rows=1))]  # fmt: skip
    assert seqs(next_batch(queue, LIMITS, {})) == [0, 2]  # max_rows: 3 + 2 > 4


def prompt(tokens: int, budget: int = 100, start: int = 0, end: int = 5) -> DecodeStep:
    return DecodeStep(start, end, torch.zeros(1, tokens, 8), DynamicCache(), budget=budget)


def test_fresh_sessions_prompts_share_a_forward_within_their_budget_and_never_with_decode_steps() -> None:
    queue = [
        task(Kind.INFERENCE, "a", 1, prompt(40)),
        task(Kind.INFERENCE, "b", 2, decode()),  # a decode step: its own kind of forward
        task(Kind.INFERENCE, "c", 3, prompt(30, start=2)),  # other blocks
        task(Kind.INFERENCE, "d", 4, prompt(70)),  # 40 + 70 > the budget of 100 tokens
        task(Kind.INFERENCE, "e", 5, prompt(35)),
        task(Kind.INFERENCE, "f", 6, prompt(25)),  # 40 + 35 + 25 = 100
    ]
    assert seqs(next_batch(queue, LIMITS, {})) == [1, 5, 6]
    assert seqs(next_batch(queue[1:], LIMITS, {})) == [2]  # a decode step heads: no prompt joins it
    # the scheduler's own limit on joined tokens bounds a large budget
    wide = dataclasses.replace(LIMITS, max_join_tokens=50)
    queue = [task(Kind.INFERENCE, "a", 1, prompt(30, 1000)), task(Kind.INFERENCE, "b", 2, prompt(30, 1000))]
    assert seqs(next_batch(queue, wide, {})) == [1]


def test_one_cache_is_never_twice_in_a_batch() -> None:
    cache = DynamicCache()
    queue = [task(Kind.INFERENCE, "a", 0, decode(cache=cache)), task(Kind.INFERENCE, "a", 1, decode(cache=cache))]
    assert seqs(next_batch(queue, LIMITS, {})) == [0]


class FakeClock:
    """A clock that moves only when a test moves it: the scheduler's timing rules read it instead of the real one."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize(
    ("stages", "hold_s", "batched"),
    [(1, 0.05, [3]), (3, 1.1, [3]), (3, 0.05, [])],
    ids=["whole-model", "third-of-a-chain-behind", "third-of-a-chain-keeping-up"],
)
def test_decode_steps_batch_while_the_compute_thread_is_busy(stages: int, hold_s: float, batched: list[int]) -> None:
    """What arrives while the thread works runs next as one batch; results go to their own callers. A server holding
    a third of a chain runs the steps of a third of the sessions at a time (here one: a lone step runs by itself),
    unless it is behind (busy all the last second, on the fake clock): then it runs all it has at once."""
    release, started, clock = threading.Event(), threading.Event(), FakeClock()
    batches: list[int] = []

    def run_decodes(steps: list[DecodeStep]) -> list[float]:
        batches.append(len(steps))
        return [float(step.hidden[0, 0, 0]) for step in steps]

    def blocking() -> str:
        started.set()
        release.wait(10)
        clock.advance(hold_s)  # the forward held the thread this long
        return "forward done"

    async def main() -> list[object]:
        limits = dataclasses.replace(LIMITS, stages=stages)
        scheduler = Scheduler(ThreadPoolExecutor(1), call, run_decodes, limits, clock=clock)
        first = asyncio.ensure_future(scheduler.submit(Kind.FORWARD, "x", blocking))
        await asyncio.to_thread(started.wait, 10)  # the forward holds the thread
        steps = [
            asyncio.ensure_future(
                scheduler.submit(
                    Kind.INFERENCE, p, lambda: "alone", DecodeStep(0, 5, torch.full((1, 1, 2), v), DynamicCache())
                )
            )
            for v, p in [(1.0, "a"), (2.0, "b"), (3.0, "c")]
        ]
        await asyncio.sleep(0)  # one turn of the loop: the steps queue behind the forward
        assert len(scheduler.queue) == 3
        release.set()
        results = await asyncio.gather(first, *steps)
        alone = await scheduler.submit(Kind.INFERENCE, "a", lambda: "alone", decode())
        return [*results, alone]

    results = asyncio.run(main())
    assert batches == batched
    assert results == ["forward done", *([1.0, 2.0, 3.0] if batched else ["alone"] * 3), "alone"]


@pytest.mark.parametrize(("later_stages", "joined"), [(0, [4]), (1, [2, 2]), (2, [2, 2])])
def test_prompts_waiting_together_split_when_servers_come_after(later_stages: int, joined: list[int]) -> None:
    """Four fresh sessions' prompts queued while the thread is busy: the last server of a chain runs them as one
    forward; one with servers after it runs them in groups of ceil(4 / (1 + later_stages)) (the next server starts
    on the first group meanwhile; over 3 groups: 2, then the 2 left, which are not split again), each caller
    getting its own result."""
    release, started = threading.Event(), threading.Event()
    batches: list[int] = []

    def run_decodes(steps: list[DecodeStep]) -> list[int]:
        batches.append(len(steps))
        return [step.tokens for step in steps]

    def blocking() -> bool:
        started.set()
        return release.wait(10)

    async def main() -> list[object]:
        limits = BatchLimits(stages=1 + later_stages, later_stages=later_stages)
        scheduler = Scheduler(ThreadPoolExecutor(1), call, run_decodes, limits, clock=FakeClock())
        first = asyncio.ensure_future(scheduler.submit(Kind.FORWARD, "x", blocking))
        await asyncio.to_thread(started.wait, 10)  # the forward holds the thread
        prompts = [
            asyncio.ensure_future(scheduler.submit(Kind.INFERENCE, "a", lambda: "alone", prompt(tokens, 1000)))
            for tokens in (10, 11, 12, 13)
        ]
        await asyncio.sleep(0)  # one turn of the loop: the prompts queue behind the forward
        release.set()
        return await asyncio.gather(first, *prompts)

    assert asyncio.run(main()) == [True, 10, 11, 12, 13]
    assert batches == joined


def test_a_queued_task_holds_its_item_as_data_and_the_executor_runs_it() -> None:
    """What a caller submits waits in the queue as it is (readable data, not a closure), and the scheduler's
    executor gets that very item and answers with its result."""
    release, started = threading.Event(), threading.Event()
    ran: list[object] = []

    def execute(item: object) -> str:
        ran.append(item)
        if item == "hold":
            started.set()
            release.wait(10)
        return f"ran {item}"

    item = ("blocks", 0, 5)

    async def main() -> list[object]:
        scheduler = Scheduler(ThreadPoolExecutor(1), execute, lambda steps: [], LIMITS)
        first = asyncio.ensure_future(scheduler.submit(Kind.FORWARD, "x", "hold"))
        await asyncio.to_thread(started.wait, 10)
        second = asyncio.ensure_future(scheduler.submit(Kind.FORWARD, "y", item))
        await asyncio.sleep(0)  # one turn of the loop: it waits behind the first
        assert [t.work.item for t in scheduler.queue if t.work is not None] == [item]
        release.set()
        return [await first, await second]

    assert asyncio.run(main()) == ["ran hold", "ran ('blocks', 0, 5)"]
    assert ran == ["hold", item]


def test_a_failure_reaches_its_callers_and_the_queue_goes_on() -> None:
    def boom() -> None:
        raise ValueError("bad")

    async def main() -> object:
        scheduler = Scheduler(ThreadPoolExecutor(1), call, lambda steps: [], LIMITS)
        try:
            await scheduler.submit(Kind.FORWARD, "x", boom)
        except ValueError:
            pass
        else:
            raise AssertionError("the failure was lost")
        return await scheduler.submit(Kind.FORWARD, "x", lambda: 42)

    assert asyncio.run(main()) == 42


def test_inference_steps_run_between_the_blocks_of_a_long_request() -> None:
    """A long request runs a quantum (block) at a time: a step that arrives meanwhile waits at most LONG_TURNS
    quanta, not all."""
    order: list[str] = []
    started, queued = threading.Event(), threading.Event()

    def long_forward():  # a generator, as SpanBackend._run_by_block
        for block in range(4):
            yield  # before each quantum
            order.append(f"block {block}")
            started.set()
            queued.wait(10)  # the first block ends once the step waits in the queue
        return "forward done"

    async def main() -> list[object]:
        scheduler = Scheduler(ThreadPoolExecutor(1), call, lambda steps: [], LIMITS)
        forward = asyncio.ensure_future(scheduler.submit(Kind.FORWARD, "trainer", long_forward))
        await asyncio.to_thread(started.wait, 10)
        step = asyncio.ensure_future(
            scheduler.submit(Kind.INFERENCE, "user", lambda: order.append("step") or "step done")
        )
        await asyncio.sleep(0)  # one turn of the loop: the step is queued
        queued.set()
        return [await forward, await step]

    assert asyncio.run(main()) == ["forward done", "step done"]
    # the step ran after at most LONG_TURNS blocks, before the forward's other blocks
    assert order == [f"block {b}" for b in range(LONG_TURNS)] + ["step"] + [f"block {b}" for b in range(LONG_TURNS, 4)]


def test_a_caller_that_gives_up_stops_its_long_request() -> None:
    ran: list[int] = []
    started = threading.Event()

    def endless():
        while True:
            yield
            ran.append(1)
            started.set()

    async def main() -> None:
        scheduler = Scheduler(ThreadPoolExecutor(1), call, lambda steps: [], LIMITS)
        forward = asyncio.ensure_future(scheduler.submit(Kind.FORWARD, "x", endless))
        await asyncio.to_thread(started.wait, 10)
        forward.cancel()
        await asyncio.sleep(0)
        done = len(ran)
        # another peer's request runs next; by then the forward ran at most the quantum in progress
        at_turn = await scheduler.submit(Kind.FORWARD, "y", lambda: len(ran))
        assert at_turn <= done + 1
        assert await scheduler.submit(Kind.FORWARD, "y", lambda: 7) == 7
        assert len(ran) == at_turn  # no more quanta once its caller is gone

    asyncio.run(main())


def test_long_work_runs_in_small_quanta_while_sessions_decode_and_in_whole_blocks_otherwise() -> None:
    """The decision itself, on a fake clock: a decode step arriving meanwhile waits for the quantum in progress."""
    limits, state = BatchLimits(quantum_tokens=128, active_s=1.0), SchedulerState()
    forward = Task(Kind.FORWARD, "trainer", 1)
    assert schedule([forward], state, limits, 0.0) == Decision([forward], quantum=0)  # nobody decodes here
    step = decode()
    state.track(step, 0.0)
    assert schedule([forward], state, limits, 0.5) == Decision([forward], quantum=128)  # a session stepped 0.5 s ago
    assert schedule([forward], state, limits, 1.5).quantum == 0  # it has been idle for longer than active_s
    state.track(step, 1.6)
    assert schedule([forward], state, limits, 1.7).quantum == 128
    assert schedule([forward], state, dataclasses.replace(limits, quantum_tokens=0), 1.7).quantum == 0
    state.forget(step.cache)
    assert schedule([forward], state, limits, 1.7).quantum == 0  # the session ended


def test_the_executor_sends_each_quantum_its_size() -> None:
    sizes: list[int | None] = []

    def long_forward():  # a generator, as SpanBackend._run_by_block
        for _ in range(3):
            sizes.append((yield))
        return "done"

    async def main() -> None:
        scheduler = Scheduler(ThreadPoolExecutor(1), call, lambda steps: [], BatchLimits(quantum_tokens=64))
        assert await scheduler.submit(Kind.FORWARD, "trainer", long_forward) == "done"
        scheduler.state.track(decode(), scheduler.clock())  # a session decodes here
        assert await scheduler.submit(Kind.BACKWARD, "trainer", long_forward) == "done"

    asyncio.run(main())
    assert sizes == [0, 0, 0, 64, 64, 64]


def test_a_decode_step_waits_for_a_session_due_within_the_wait_and_no_longer() -> None:
    """The decision itself: session b steps every 100 ms (last at 0.0: next due at 0.1); a's step, queued at 0.06,
    waits for it until 0.1 + the jitter slack, not until its own limit (0.16), and runs alone past that."""
    limits, state = BatchLimits(decode_wait_s=0.1), SchedulerState()
    a, b = decode(), decode()
    state.track(b, -0.1)
    state.track(b, 0.0)
    queued = Task(Kind.INFERENCE, "a", 1, a, arrived=0.06)
    state.track(a, 0.06)
    assert schedule([queued], state, limits, 0.06) == Decision(wait_until=pytest.approx(0.105))
    assert schedule([queued], state, limits, 0.106).batch == [queued]  # b is overdue: not waited for any more
    state.forget(b.cache)
    assert schedule([queued], state, limits, 0.06).batch == [queued]  # b ended: never waited for
    assert schedule([queued], state, BatchLimits(decode_wait_s=0.0), 0.06).batch == [queued]


def rhythmic_sessions(
    limits: BatchLimits, offsets_s: list[float], intervals_s: list[float], steps: int, forget_after: int | None = None,
    compute_s: float = 0.002,
) -> tuple[list[int], list[list[float]]]:  # fmt: skip
    """Sessions stepping intervals_s[i] after each answer, each starting at its offset, simulated on a fake clock:
    the compute thread runs what `schedule` decides, compute_s per batch, and a wait ends at its time or at the next
    arrival (as the executor's). The sizes of the forwards that ran more than one session and each session's
    per-step latency (queued to answered). With forget_after, session 1 ends after that many steps."""
    state, queue, batches = SchedulerState(), [], []
    caches = [DynamicCache() for _ in offsets_s]
    left = [forget_after if i == 1 and forget_after is not None else steps for i in range(len(offsets_s))]
    due: list[float | None] = list(offsets_s)  # each session's next step (or its end); None while a step waits
    latencies: list[list[float]] = [[] for _ in offsets_s]
    now, arrivals = 0.0, 0
    while queue or any(at is not None for at in due):
        for i, at in enumerate(due):
            if at is None or at > now:
                continue
            due[i] = None
            if left[i] == 0:
                state.forget(caches[i])
                continue
            arrivals += 1
            step = decode(cache=caches[i])
            state.track(step, now)
            queue.append(Task(Kind.INFERENCE, f"peer{i}", arrivals, step, arrived=now))
        decision = schedule(queue, state, limits, now) if queue else Decision()
        if decision.batch:
            for queued in decision.batch:
                queue.remove(queued)
            state.served([queued.peer for queued in decision.batch], {queued.peer for queued in queue})
            state.ran(now, now + compute_s)
            now += compute_s
            batches += [len(decision.batch)] if len(decision.batch) > 1 else []
            for queued in decision.batch:
                i = int(queued.peer.removeprefix("peer"))
                latencies[i].append(now - queued.arrived)
                left[i] -= 1
                due[i] = now + intervals_s[i]
            continue
        now = min([at for at in due if at is not None] + [decision.wait_until or math.inf])
    return batches, latencies


def test_sessions_due_soon_are_waited_for_and_fall_into_step() -> None:
    # two sessions 40 ms out of phase: without waiting they never meet; with a 100 ms wait they soon share forwards
    apart, _ = rhythmic_sessions(BatchLimits(decode_wait_s=0.0), [0.0, 0.04], [0.1, 0.1], steps=8)
    assert apart == []
    together, latencies = rhythmic_sessions(BatchLimits(decode_wait_s=0.1), [0.0, 0.04], [0.1, 0.1], steps=8)
    assert together.count(2) >= 4
    assert max(max(session) for session in latencies) < 0.1 + 0.05  # no step waits much beyond the limit


def test_a_session_not_due_soon_and_an_ended_one_are_never_waited_for() -> None:
    # session 1 steps every 0.3 s (a far client): session 0, stepping every 20 ms, does not wait for it
    _, latencies = rhythmic_sessions(BatchLimits(decode_wait_s=0.1), [0.0, 0.005], [0.02, 0.3], steps=10)
    assert sorted(latencies[0])[len(latencies[0]) // 2] < 0.02
    # a session that ended is not waited for either, though it stepped in rhythm until then
    _, latencies = rhythmic_sessions(
        BatchLimits(decode_wait_s=0.1), [0.0, 0.01], [0.05, 0.05], steps=10, forget_after=3
    )
    assert sorted(latencies[0])[-3] < 0.02


def test_a_server_in_a_chain_of_two_batches_half_the_active_sessions() -> None:
    # four sessions in rhythm: one server of a one-server chain waits for all of them; in a chain of two, its batches
    # hold two (one cohort), so it computes one cohort while the other is at the next server
    offsets, intervals = [0.0, 0.01, 0.02, 0.03], [0.1] * 4
    alone, _ = rhythmic_sessions(BatchLimits(decode_wait_s=0.1), offsets, intervals, steps=8)
    assert max(alone) == 4
    chained, latencies = rhythmic_sessions(BatchLimits(decode_wait_s=0.1, stages=2), offsets, intervals, steps=8)
    assert max(chained) == 2 and chained.count(2) >= 8
    assert max(max(session) for session in latencies) < 0.1 + 0.05


def test_a_server_behind_batches_every_step_it_has() -> None:
    # the same four sessions on a server busy nearly all the time (each forward takes 95% of a step's interval):
    # a chain of two no longer splits them into cohorts
    offsets, intervals = [0.0, 0.01, 0.02, 0.03], [0.005] * 4
    chained, _ = rhythmic_sessions(
        BatchLimits(decode_wait_s=0.1, stages=2), offsets, intervals, steps=8, compute_s=0.1
    )
    assert max(chained) == 4


def simulate_turns(queue: list[Task], refill, turns: int) -> list[Task]:  # refill(task) -> Task
    """Run `turns` decisions on a fake clock as the executor would: each batch is served, and each task that ran
    is replaced by refill(task) (a flood that never runs dry). The heads of the batches that ran, in order."""
    limits, state, ran = BatchLimits(quantum_tokens=256, decode_wait_s=0.0), SchedulerState(), []
    for turn in range(turns):
        decision = schedule(queue, state, limits, float(turn))
        assert decision.batch, decision
        waiting = {task.peer for task in queue} | {task.host for task in queue}
        for task in decision.batch:
            queue.remove(task)
            queue.append(refill(task))
        state.served([t.peer for t in decision.batch], waiting, [t.host for t in decision.batch],
                     long=decision.batch[0].kind in LONG_KINDS)  # fmt: skip
        ran.append(decision.batch[0])
    return ran


@pytest.mark.parametrize("long_kind", [Kind.PROMPT, Kind.FORWARD, Kind.BACKWARD])
def test_short_steps_and_long_work_take_turns_so_neither_floods_out_the_other(long_kind: Kind) -> None:
    """Six peers' long prompts (or a trainer's forwards) against sessions decoding flat out: whichever floods, the
    other keeps its turns: a decode step waits for at most LONG_TURNS quanta, and the long work gets LONG_TURNS
    quanta per decode batch."""
    seq = iter(range(10**6))
    queue = [Task(long_kind, f"flood{i}", next(seq), host="10.0.0.9") for i in range(6)]
    queue += [Task(Kind.INFERENCE, f"user{i}", next(seq), decode=decode(), host=f"10.0.1.{i}") for i in range(4)]
    ran = simulate_turns(queue, lambda task: dataclasses.replace(task, seq=next(seq)), 40)
    kinds = "".join("L" if task.kind in LONG_KINDS else "s" for task in ran)
    # LONG_TURNS quanta of long work, then a batch of short steps, over and over
    assert "L" * (LONG_TURNS + 1) not in kinds and "ss" not in kinds, kinds
    assert abs(kinds.count("L") - LONG_TURNS * kinds.count("s")) <= LONG_TURNS, kinds


def test_turns_go_round_hosts_before_peers() -> None:
    """One host's fifty peer ids get, together, the turns one peer of another host gets."""
    seq = iter(range(10**6))
    queue = [Task(Kind.FORWARD, f"sybil{i}", next(seq), host="10.0.0.2") for i in range(50)]
    queue.append(Task(Kind.FORWARD, "honest", next(seq), host="10.0.0.3"))
    ran = simulate_turns(queue, lambda task: dataclasses.replace(task, seq=next(seq)), 40)
    assert sum(task.peer == "honest" for task in ran) == 20
    sybils = [task.peer for task in ran if task.peer != "honest"]
    assert len(set(sybils)) == len(sybils)  # the host's own turns go round its peers


def test_alone_long_work_and_short_steps_run_as_before() -> None:
    """Without the other kind waiting, nothing changes: short steps first, then long work by turns."""
    queue = [Task(Kind.PROMPT, "a", 1, host="h1"), Task(Kind.FORWARD, "b", 2, host="h2")]
    limits, state = BatchLimits(), SchedulerState()
    assert seqs(schedule(queue, state, limits, 0.0).batch) == [1]  # by kind when no turn says otherwise
    state.served(["a"], {"b", "h2"}, ["h1"], long=True)
    assert seqs(schedule(queue, state, limits, 0.0).batch) == [2]  # b's host was not served yet
    step = Task(Kind.INFERENCE, "c", 3, decode=decode(), host="h3")
    state.served(["b"], {"a", "h1"}, ["h2"], long=True)
    assert state.long_turns == LONG_TURNS
    assert seqs(schedule([*queue, step], state, limits, 0.0).batch) == [3]  # long work had its turns: the step goes


def test_a_fresh_sessions_long_prompt_runs_in_quanta_while_sessions_decode() -> None:
    limits, state = BatchLimits(quantum_tokens=256), SchedulerState()
    prompt = DecodeStep(0, 5, torch.zeros(1, 1024, 8), DynamicCache(), budget=1024)
    long = Task(Kind.PROMPT, "flood", 1, decode=prompt, host="h1")
    assert schedule([long], state, limits, 0.0) == Decision([long], quantum=0)  # nobody decodes: whole chunks
    step = decode()
    state.track(step, 0.0)
    assert schedule([long], state, limits, 0.1) == Decision([long], quantum=256)


def test_one_computation_that_builds_graphs_is_started_at_a_time_while_other_work_interleaves() -> None:
    """Backwards (and forwards that keep their graph) hold autograd graphs growing with their progress: three of
    them, from three hosts, run one after another, each to its end once started, while a plain forward of a fourth
    host takes its turns in between them."""
    order: list[str] = []

    def computation(name: str):  # a generator, as SpanBackend._run_by_block
        def run():
            for block in range(3):
                yield
                order.append(f"{name}{block}")
            return name

        return run

    async def main() -> list[object]:
        scheduler = Scheduler(ThreadPoolExecutor(1), call, lambda steps: [], LIMITS)
        release = threading.Event()
        busy = asyncio.ensure_future(hold(scheduler, release))
        await asyncio.sleep(0.05)  # the compute thread is busy: everything below waits in the queue together
        runs = [
            asyncio.ensure_future(
                scheduler.submit(Kind.BACKWARD, f"p{i}", computation(name), host=f"10.0.0.{i}", exclusive=True)
            )  # fmt: skip
            for i, name in enumerate("abc")
        ]
        runs.append(asyncio.ensure_future(scheduler.submit(Kind.FORWARD, "p9", computation("f"), host="10.0.0.9")))
        await asyncio.sleep(0.05)
        release.set()
        await busy
        return list(await asyncio.gather(*runs))

    assert asyncio.run(main()) == ["a", "b", "c", "f"]
    graphs = [step for step in order if step[0] != "f"]
    assert graphs == ["a0", "a1", "a2", "b0", "b1", "b2", "c0", "c1", "c2"]  # never two started at once
    first, last = order.index("a0"), order.index("c2")
    assert any(first < order.index(f"f{block}") < last for block in range(3))  # the plain forward ran in between
