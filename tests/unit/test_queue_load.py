"""Queue depth: the server's measure of waiting work, its announcement, the client's cost of it, and exploration
of servers the client never measured. No sockets."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.swarm_view import QUEUE_LOAD, SESSION_LOAD, announced_load
from swarmlm.config import ClientConfig
from swarmlm.protocol.messages import ServerInfo
from swarmlm.server.load import DepthMeter, turns_ahead
from swarmlm.server.scheduler import BatchLimits, Kind, Scheduler
from swarmlm.swarm.records import ServerRecord, ServerState
from tests.unit.test_scheduler import FakeClock, call, decode, task


def test_decode_steps_share_a_turn_and_other_work_takes_one_each() -> None:
    queue = [task(Kind.INFERENCE, p, i, decode()) for i, p in enumerate("abcde")]
    assert turns_ahead(queue, max_sessions=3) == 2  # five steps: two batched forwards
    queue += [task(Kind.FORWARD, "f", 5), task(Kind.BACKWARD, "g", 6), task(Kind.INFERENCE, "h", 7)]
    assert turns_ahead(queue, max_sessions=3) == 5
    assert turns_ahead([], max_sessions=3) == 0


def test_the_depth_meter_averages_over_time() -> None:
    meter = DepthMeter(time_constant_s=10.0)
    assert meter.value(0.0) == 0.0
    meter.set(4.0, 0.0)
    assert meter.value(0.0) == 0.0  # a depth seen for no time yet moves nothing
    assert meter.value(10.0) == pytest.approx(4.0 * (1 - 1 / 2.718281828), rel=1e-6)
    assert meter.value(1000.0) == pytest.approx(4.0)  # held long enough, the average is the depth
    meter.set(0.0, 1000.0)
    assert meter.value(1000.0) == pytest.approx(4.0)
    assert meter.value(1030.0) < 0.25  # the queue emptied: the figure fades within a few time constants
    meter.set(2.0, 500.0)  # a clock that goes back counts no negative time
    assert 0.0 <= meter.value(1030.0) <= 4.0


def test_the_scheduler_measures_the_work_waiting_behind_a_busy_thread() -> None:
    release, started, clock = threading.Event(), threading.Event(), FakeClock()

    def blocking() -> bool:
        started.set()
        return release.wait(10)

    async def main() -> tuple[float, float]:
        run_decodes = lambda steps: [None] * len(steps)  # noqa: E731 - one line
        scheduler = Scheduler(ThreadPoolExecutor(1), call, run_decodes, BatchLimits(), clock=clock)
        scheduler.depth = DepthMeter(time_constant_s=0.05)
        idle = scheduler.queue_depth()
        running = [asyncio.ensure_future(scheduler.submit(Kind.FORWARD, f"p{i}", blocking)) for i in range(4)]
        await asyncio.to_thread(started.wait, 10)
        clock.advance(0.5)  # one runs, three wait for ten time constants: the average climbs to 3
        busy = scheduler.queue_depth()
        release.set()
        await asyncio.gather(*running)
        return idle, busy

    idle, busy = asyncio.run(main())
    assert idle == 0.0 and busy == pytest.approx(3.0, rel=0.05)


def _record(start: int = 0, end: int = 4, queue: float = 0.0, sessions: int = 0) -> ServerRecord:
    return ServerRecord(
        state=ServerState.ONLINE, start=start, end=end, throughput=100.0, dtype="float32", queue_depth=queue,
        sessions_open=sessions,
    )  # fmt: skip


def test_records_and_infos_carry_the_queue_depth_and_old_ones_parse() -> None:
    old = {"state": "online", "start": 0, "end": 4, "throughput": 10.0, "dtype": "float32"}
    assert ServerRecord.model_validate(old).queue_depth == 0.0
    assert _record(queue=1.5).model_dump(mode="json")["queue_depth"] == 1.5
    with pytest.raises(ValueError):
        _record(queue=-1.0)  # a negative queue would make a server look faster than measured
    info = dict(kind="server_info", start_block=0, end_block=4, version="x", fingerprint="f", dtype="float32",
                max_tokens_per_request=8, max_position=8, cache_tokens_total=8, cache_tokens_left=8,
                sessions_open=0, throughput=1.0, inference_throughput=1.0)  # fmt: skip
    assert ServerInfo.model_validate(info).queue_depth == 0.0
    assert ServerInfo.model_validate({**info, "queue_depth": 2.5}).queue_depth == 2.5


def test_the_expected_wait_raises_a_servers_cost() -> None:
    assert announced_load(_record(queue=2.0, sessions=3)) == pytest.approx(2.0 * QUEUE_LOAD + 3 * SESSION_LOAD)
    # fresh clients (no stickiness, no measurements) route around the replica with a queue
    chosen = set()
    for seed in range(30):
        manager = _manager({"idle": _record(), "queued": _record(queue=1.0)}, explore_interval_s=0)
        manager._rng = random.Random(seed)
        chosen.add(asyncio.run(manager.make_route(0, 4))[0].peer_id)
    assert chosen == {"idle"}


def _manager(records: dict[str, ServerRecord], **options: float) -> SequenceManager:
    manager = SequenceManager(ClientConfig(missing_blocks_timeout_s=0.0, **options), "test", num_blocks=4)
    manager.view.update(records)
    return manager


def test_the_client_tries_a_server_it_never_measured_once_per_interval() -> None:
    manager = _manager({"known": _record(), "new": _record(queue=1.0)}, explore_interval_s=0.3)
    manager.health.record_success("known", 0.01, 4)
    routes = [asyncio.run(manager.make_route(0, 4))[0].peer_id for _ in range(10)]
    assert routes == ["known"] * 10  # the interval has not passed since the client started
    time.sleep(0.35)
    routes = [asyncio.run(manager.make_route(0, 4))[0].peer_id for _ in range(10)]
    assert routes[0] == "new" and routes[1:] == ["known"] * 9  # one try, then the costs decide again
    manager.health.record_success("new", 0.01, 4)
    time.sleep(0.35)
    # every server measured: nothing left to explore, the route stays where the costs (and stickiness) keep it
    assert {asyncio.run(manager.make_route(0, 4))[0].peer_id for _ in range(10)} == {"known"}


def test_exploring_never_uses_a_banned_server_and_can_be_turned_off() -> None:
    manager = _manager({"known": _record(), "new": _record()}, explore_interval_s=0.01)
    manager.health.record_success("known", 0.01, 4)
    manager.ban("new", "test")
    time.sleep(0.02)
    assert asyncio.run(manager.make_route(0, 4))[0].peer_id == "known"
    never = _manager({"known": _record(), "new": _record(queue=1.0)}, explore_interval_s=0)
    never.health.record_success("known", 0.01, 4)
    never._explored_at -= 3600
    assert {asyncio.run(never.make_route(0, 4))[0].peer_id for _ in range(10)} == {"known"}
