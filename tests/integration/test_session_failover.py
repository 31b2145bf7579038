"""Client inference sessions under failures: refused opens, SIGKILLed servers, steps that cannot complete.

A step is all or nothing: it returns hidden states only after every block ran it; otherwise it raises, and the next
step first brings every server back to the session's position. Outputs always equal a local run of the blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.errors import MissingBlocksError, RemoteCallError, SwarmError
from swarmlm.models.span import SpanModel
from swarmlm.tools.local_swarm import LocalServer, LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, running_swarm

NUM_BLOCKS = 5
HIDDEN_SIZE = 64
CACHE_TOKENS = 64  # each server's KV-cache budget
# a busy server answers after this long; small, so that refused opens are quick
ALLOC_TIMEOUT_S = 0.5
# how long the client waits for a block nobody serves before MissingBlocksError
MISSING_BLOCKS_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    # one client fills the whole cache here: its share may be all of it
    extra_args = [
        "--cache-tokens", str(CACHE_TOKENS), "--alloc-timeout", str(ALLOC_TIMEOUT_S), "--peer-cache-share", "1"
    ]  # fmt: skip
    spans = [(0, 2), (2, 4), (4, NUM_BLOCKS), (2, NUM_BLOCKS)]  # blocks 2:5 have two servers
    with running_swarm(tiny_model_dir, spans, extra_args=extra_args) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path, swarm: LocalSwarm) -> Iterator[torch.nn.Module]:
    options = dict(missing_blocks_timeout_s=MISSING_BLOCKS_TIMEOUT_S, ban_base_s=0.2, ban_max_s=1.0)
    with connected_model(tiny_model_dir, swarm, **options) as model:
        yield model


@pytest.fixture(scope="module")
def span(tiny_model_dir: Path) -> SpanModel:
    return SpanModel.from_dir(tiny_model_dir, 0, NUM_BLOCKS)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def local(span: SpanModel, hidden: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return span(hidden)


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape
    assert torch.allclose(out, expected, atol=LOGITS_ATOL), (out - expected).abs().max()


def server_of(swarm: LocalSwarm, peer_id: str) -> LocalServer:
    return next(server for server in swarm.servers if server.peer_id == peer_id)


def session_server(swarm: LocalSwarm, session: object, block: int) -> LocalServer:
    return server_of(swarm, next(s.peer_id for s in session.route if s.start <= block < s.end))


def count_in_log(server: LocalServer, text: str) -> int:
    return server.log_path.read_text(errors="replace").count(text)


def wait_for(condition: callable, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_refused_open_closes_the_streams_it_opened_and_the_next_step_works(model, swarm, span) -> None:
    layers, first = model.model.layers, swarm.servers[0]
    # sessions holding the whole cache of both servers of block 2: no route through block 2 can open. A session
    # reserves cache at the blocks it uses only: 96 tokens at 2 blocks fill the 2:5 server (64 tokens x 3 blocks)
    # and fit nowhere else, then 64 tokens at 2 blocks fill the 2:4 one
    blockers = [layers[2:4].inference_session(max_length=length) for length in (CACHE_TOKENS * 3 // 2, CACHE_TOKENS)]
    for blocker in blockers:
        blocker.step(randn(1, 1, HIDDEN_SIZE, seed=0))
    assert {s.peer_id for b in blockers for s in b.route} == {swarm.servers[1].peer_id, swarm.servers[3].peer_id}
    hidden = randn(1, 4, HIDDEN_SIZE, seed=1)
    session = layers.inference_session(max_length=8)
    opened_before = count_in_log(first, "inference open blocks=0:2")
    with pytest.raises(SwarmError):
        session.step(hidden[:, :3])
    assert session.position == 0 and session.batch_size is None
    # the stream opened on the first server was closed at once, not left to the idle timeout
    assert count_in_log(first, "inference open blocks=0:2") == opened_before + 1
    assert wait_for(lambda: count_in_log(first, "inference closed blocks=0:2") == opened_before + 1), first.log_tail()

    for blocker in blockers:
        blocker.close()
    assert_close(session.step(hidden[:, :3]), local(span, hidden[:, :3]))
    assert_close(session.step(hidden[:, 3:]), local(span, hidden)[:, 3:])
    session.close()


def test_a_server_killed_mid_session_is_replaced_after_a_rollback(model, swarm, span) -> None:
    hidden, other = randn(1, 8, HIDDEN_SIZE, seed=2), randn(1, 3, HIDDEN_SIZE, seed=3)
    with model.model.layers.inference_session(max_length=16) as session:
        session.step(hidden[:, :4])
        session.step(hidden[:, 4:])
        session.position = 6  # the replacement must replay exactly the kept 6 tokens
        victim = session_server(swarm, session, 2)  # a middle or last span; blocks 2:5 have a replica
        swarm.kill(victim)
        out = session.step(other)
        assert victim.peer_id not in {s.peer_id for s in session.route}
        assert_close(out, local(span, torch.cat([hidden[:, :6], other], dim=1))[:, 6:])
        assert_close(
            session.step(hidden[:, :1]), local(span, torch.cat([hidden[:, :6], other, hidden[:, :1]], 1))[:, 9:]
        )
    swarm.add_server(victim.start, victim.end)  # the swarm as it was for the next test


def test_a_step_that_cannot_complete_raises_and_the_next_step_recovers(model, swarm, span) -> None:
    past, failed, retried = (
        randn(2, 3, HIDDEN_SIZE, seed=4),
        randn(2, 1, HIDDEN_SIZE, seed=5),
        randn(2, 2, HIDDEN_SIZE, seed=6),
    )
    swap = torch.tensor([1, 0])
    session = model.model.layers.inference_session(max_length=16)
    session.step(past)
    # no server is left for block 4: the step's earlier spans run it (reordering their caches), the last cannot
    for server in [s for s in swarm.servers if s.end == NUM_BLOCKS and s.process.poll() is None]:
        swarm.kill(server)
    # the dead servers' records are still in the DHT: either the client gives up on them, or it finds no route
    with pytest.raises((MissingBlocksError, RemoteCallError)):
        session.step(failed, hypo_ids=swap)
    assert session.position == 3
    fresh = model.model.layers.inference_session(max_length=4)
    with pytest.raises((MissingBlocksError, RemoteCallError)):
        fresh.step(failed)

    swarm.add_server(4, NUM_BLOCKS)
    # the failed step left no trace: its reorder and its token are gone from every server's cache
    out = session.step(retried, hypo_ids=swap)
    assert session.position == 5
    assert_close(out, local(span, torch.cat([past[swap], retried], dim=1))[:, 3:])
    assert_close(fresh.step(failed), local(span, failed))
    session.close()
    fresh.close()
