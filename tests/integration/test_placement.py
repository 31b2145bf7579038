"""Servers that choose their blocks, fill gaps left by a crashed server, and drain before leaving."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from swarmlm.models.naming import default_dht_prefix
from swarmlm.swarm.records import ServerRecord, ServerState, servers_key
from swarmlm.tools.local_swarm import LocalServer, LocalSwarm
from tests.conftest import LOGITS_ATOL, build_tiny_llama, connected_model, load_reference, running_swarm

NUM_BLOCKS = 7
# short intervals so that a crash is noticed and repaired within seconds
FAST = ["--announce-interval", "1", "--record-ttl", "4", "--rebalance-interval", "2"]
DRAIN_TIMEOUT_S = 3.0
# a draining server exits this long after its drain deadline at most (OFFLINE record, DHT and p2pd shutdown)
EXIT_SLACK_S = 8.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-7"), num_layers=NUM_BLOCKS)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> torch.nn.Module:
    return load_reference(model_dir)


def online_spans(swarm: LocalSwarm, model_dir: Path) -> dict[str, tuple[int, int]]:
    """Spans of the ONLINE records of live servers, by peer id."""
    found = swarm.dht.get(servers_key(default_dht_prefix(str(model_dir))), latest=True)
    alive = {server.peer_id for server in swarm.servers if server.process.poll() is None}
    spans = {}
    for peer_id, entry in ({} if found is None else found.value).items():
        record = ServerRecord.model_validate(entry.value)
        if record.state == ServerState.ONLINE and peer_id in alive:
            spans[peer_id] = (record.start, record.end)
    return spans


def covers_all(spans: dict[str, tuple[int, int]]) -> bool:
    return all(any(start <= block < end for start, end in spans.values()) for block in range(NUM_BLOCKS))


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def assert_forward_equals_local(model_dir: Path, swarm: LocalSwarm, reference: torch.nn.Module) -> None:
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    with connected_model(model_dir, swarm) as model, torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=LOGITS_ATOL, rtol=0)


def test_servers_started_together_cover_the_model_and_fill_the_gap_of_a_crashed_one(model_dir, reference) -> None:
    with LocalSwarm(str(model_dir), threads_per_server=1) as swarm:
        # two survivors of 4 blocks can cover 7 blocks; two of 3 could not, so none would move
        servers = [swarm.add_server(num_blocks=4, wait=False, extra_args=FAST) for _ in range(3)]
        swarm.wait_ready(servers)
        # they spread out as they joined (a server announces ONLINE before it says it is ready), not by moving later
        assert wait_for(lambda: covers_all(online_spans(swarm, model_dir)), 3), online_spans(swarm, model_dir)
        assert not any("Moving from blocks" in s.log_tail(200) for s in servers)
        assert_forward_equals_local(model_dir, swarm, reference)

        # crash the only server of some block: a survivor moves there within a few rebalance periods
        spans = online_spans(swarm, model_dir)
        victim = next(s for s in servers if _sole_server_of_a_block(s.peer_id, spans))
        swarm.kill(victim)
        assert wait_for(lambda: covers_all(online_spans(swarm, model_dir)), 30), "\n".join(
            s.log_tail() for s in servers
        )
        assert any("Moving from blocks" in s.log_tail(200) for s in servers if s is not victim)
        assert_forward_equals_local(model_dir, swarm, reference)


def _sole_server_of_a_block(peer_id: str | None, spans: dict[str, tuple[int, int]]) -> bool:
    start, end = spans[peer_id or ""]
    others = [span for peer, span in spans.items() if peer != peer_id]
    return any(not any(s <= block < e for s, e in others) for block in range(start, end))


def test_sigterm_mid_generation_drains_and_the_generation_completes_as_local(model_dir, reference) -> None:
    flags = [*FAST, "--drain-timeout", str(DRAIN_TIMEOUT_S)]
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    expected = reference.generate(ids, max_new_tokens=16, do_sample=False)
    with (
        running_swarm(model_dir, [(0, 4), (4, 7), (4, 7)], extra_args=flags) as swarm,
        connected_model(model_dir, swarm) as model,
        model.inference_session(max_length=64) as session,
    ):
        first = model.generate(ids, max_new_tokens=4, do_sample=False)
        peer = next(s.peer_id for s in session.route if s.start <= 4 < s.end)
        victim: LocalServer = next(s for s in swarm.servers if s.peer_id == peer)
        victim.process.send_signal(signal.SIGTERM)
        began = time.monotonic()
        assert wait_for(lambda: "Shutting down: draining" in victim.log_tail(), 5)
        # a new session goes elsewhere: the draining server is no longer online, and refuses it as busy if asked
        with model.model.layers[4:7].inference_session(max_length=8) as fresh:
            fresh.step(torch.randn(1, 3, 64))
            assert peer not in {s.peer_id for s in fresh.route}
        # the draining server goes on serving the open session
        second = model.generate(first, max_new_tokens=4, do_sample=False)
        victim.process.wait(DRAIN_TIMEOUT_S + EXIT_SLACK_S)
        assert time.monotonic() - began < DRAIN_TIMEOUT_S + EXIT_SLACK_S
        assert victim.process.returncode == 0
        log = victim.log_tail(300)
        assert "Closing 1 inference sessions still open" in log, log
        # it closed the session at its deadline: the client rebuilds it on the replica
        output = model.generate(second, max_new_tokens=8, do_sample=False)
        assert peer not in {s.peer_id for s in session.route}
    assert output.tolist() == expected.tolist()


def test_a_server_without_open_sessions_exits_at_once_on_sigterm(model_dir) -> None:
    with running_swarm(model_dir, [(0, 7)], extra_args=["--drain-timeout", "20"]) as swarm:
        server = swarm.servers[0]
        began = time.monotonic()
        swarm.stop_server(server)
        assert server.process.returncode == 0
        assert time.monotonic() - began < EXIT_SLACK_S  # nothing open: no need to wait for the deadline
