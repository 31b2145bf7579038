"""Spot checks on a real swarm: two honest servers and a tampering one (hostile_server.py) for every block of the
tiny model. A server returning wrong results is caught within a bounded number of requests and reported on the DHT;
the user's results stay equal to a local run; honest servers are never convicted."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmlm.models.naming import model_name
from swarmlm.swarm.records import servers_key
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm
from tests.integration.hostile_server import PERTURBED_LINE
from tests.integration.test_client_resilience import Hostile, add_hostile, manager_of
from tests.integration.test_public_swarm import FAKE_KEYS, silent_port, store_fakes

# honest requests (varied shapes) during which no honest server may be convicted at the default tolerance
HONEST_REQUESTS = 200
# requests through a server that perturbs half of its replies, checked with probability 1/2, before it must be
# caught: a miss has probability (3/4)^40 < 1e-4
SOMETIMES_BOUND = 40
# fresh sessions, routed at random among the three servers, until one meets the hostile server: it serves a third of
# them (and checks some of the others), so 30 sessions all miss it with probability below (2/3)^30 < 1e-5
SESSIONS_TO_MEET = 30
# routes drawn at random among all three servers, none preferred for having served last (measured costs alone may keep
# a client off one of them for good: a server it never called counts as no cheaper than those it did)
SPREAD = dict(route_tie_tolerance=100.0, route_stickiness=0.0, sticky_route_s=0.0)
# servers re-announce every 10 s: a client whose first DHT read missed one sees it within a few refreshes
SEEN_WITHIN_S = 60.0


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir)


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSwarm, Hostile]]:
    """Two honest servers of blocks 0:5 and one hostile one that a fresh client tries first (it claims speed)."""
    mode_file = tmp_path_factory.mktemp("tamper") / "mode"
    mode_file.write_text("honest")
    with running_swarm(tiny_model_dir, [(0, 5), (0, 5)]) as local:
        yield local, Hostile(add_hostile(local, 0, 5, mode_file), mode_file)


def _see_every_server(model: torch.nn.Module, local: LocalSwarm) -> None:
    """Wait until the client's view of the swarm holds every server: a DHT read can miss a record for a while (the
    nodes it asks may hold an older version of the records' dictionary), and a missing server is never routed to."""
    manager, deadline = manager_of(model), time.monotonic() + SEEN_WITHIN_S
    expected = {server.peer_id for server in local.servers}
    while not expected <= set(manager.servers):
        if time.monotonic() > deadline:
            pytest.fail(f"the client sees {sorted(manager.servers)} of {sorted(expected)} after {SEEN_WITHIN_S} s")
        time.sleep(0.5)
        model.client.loop.run(manager.refresh())


def _local(reference: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return reference(ids).logits


def _ids(seed: int, batch: int = 2, seq: int = 7) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_honest_servers_are_never_convicted(tiny_model_dir: Path, reference, swarm) -> None:
    local, hostile = swarm
    hostile.set("honest")
    with connected_model(tiny_model_dir, local, verify_probability=1.0) as model:
        manager = manager_of(model)
        for i in range(HONEST_REQUESTS):
            ids = _ids(i, batch=1 + i % 3, seq=1 + i % 13)
            assert (model(ids).logits - _local(reference, ids)).abs().max().item() <= LOGITS_ATOL
            outcomes = {check.outcome for check in model.last_trace.checks}
            assert outcomes == {"agreed"}, model.last_trace.summary()
        assert not any(manager.health.distrusted(s.peer_id) for s in local.servers)
        assert not manager.verifier.reported


def test_a_tampering_server_is_caught_at_once_and_reported(tiny_model_dir: Path, reference, swarm) -> None:
    local, hostile = swarm
    hostile.set("perturb")
    ids = _ids(1000)
    with connected_model(tiny_model_dir, local) as model:  # default probability: new servers are always checked
        assert (model(ids).logits - _local(reference, ids)).abs().max().item() <= LOGITS_ATOL
        assert hostile.count(PERTURBED_LINE) >= 1, "the hostile server was not used"
        assert manager_of(model).health.distrusted(hostile.peer_id)
        last = model.last_trace
        # it computed the result or checked another's: either way it is in the minority
        assert any(c.outcome == f"wrong: ...{hostile.peer_id[-6:]}" for c in last.checks), last.summary()
        assert hostile.peer_id in last.servers
        for i in range(5):  # never routed through again
            assert (model(_ids(i)).logits - _local(reference, _ids(i))).abs().max().item() <= LOGITS_ATOL
            assert hostile.peer_id not in model.last_trace.servers
    # another client reads the signed report and checks the accused more often (it does not ban on hearsay)
    with connected_model(tiny_model_dir, local) as other:
        manager = manager_of(other)
        assert hostile.peer_id in manager.verifier.reported
        assert not manager.health.distrusted(hostile.peer_id)


def test_a_server_tampering_sometimes_is_caught_within_a_bounded_number_of_requests(
    tiny_model_dir: Path, reference, swarm
) -> None:
    local, hostile = swarm
    hostile.set("perturb_sometimes")
    through_hostile, checked_results = 0, 0
    with connected_model(tiny_model_dir, local, verify_probability=0.5, **SPREAD) as model:
        manager = manager_of(model)
        for i in range(10 * SOMETIMES_BOUND):  # the hostile server serves about a third of them
            ids = _ids(2000 + i)
            logits = model(ids).logits
            used = hostile.peer_id in {c.peer_id for c in model.last_trace.calls if c.kind == "forward"}
            through_hostile += used
            if model.last_trace.checks:  # a checked result is always right, whoever computed it
                checked_results += 1
                assert (logits - _local(reference, ids)).abs().max().item() <= LOGITS_ATOL
            if manager.health.distrusted(hostile.peer_id):
                break
        assert manager.health.distrusted(hostile.peer_id), f"not caught in {through_hostile} requests through it"
        assert through_hostile <= SOMETIMES_BOUND
        assert checked_results >= 1
        assert not any(manager.health.distrusted(s.peer_id) for s in local.servers if s is not hostile.server)


def test_a_server_tampering_in_sessions_is_caught_and_replaced(tiny_model_dir: Path, reference, swarm) -> None:
    """Sessions until one goes through the hostile server (as the session's server or as the checker of another's
    step, routes drawn at random): every output equals the local one, and the session that met it convicts it."""
    local, hostile = swarm
    hostile.set("perturb_sessions")
    ids = _ids(3000, batch=1, seq=6)
    with torch.inference_mode():
        expected = reference.generate(ids, max_new_tokens=12, do_sample=False)
    with connected_model(tiny_model_dir, local, **SPREAD) as model:
        _see_every_server(model, local)
        for _ in range(SESSIONS_TO_MEET):
            before = hostile.count(PERTURBED_LINE)  # the log also holds earlier tests' perturbations
            with model.inference_session(max_length=32) as session:
                output = model.generate(ids, max_new_tokens=12, do_sample=False, session=session)
            assert torch.equal(output, expected)
            assert model.last_trace.kind == "generate"
            if hostile.count(PERTURBED_LINE) > before:
                break
        else:
            pytest.fail(f"none of {SESSIONS_TO_MEET} sessions went through the hostile server")
        assert manager_of(model).health.distrusted(hostile.peer_id)


def test_a_tampering_server_among_fake_records_costs_a_ban_not_an_error(
    tiny_model_dir: Path, reference, swarm
) -> None:
    """Fake announcements of many keys (the cheapest route on paper, never answering) beside a server that lies: the
    checks' independent routes skip the fakes, the liar is convicted and routed around, and every result is exact.
    (Last in this module: the fake records stay in the DHT for the rest of its swarm's life.)"""
    local, hostile = swarm
    hostile.set("perturb")
    key = servers_key(local.dht_prefix or model_name(str(tiny_model_dir)).swarm)
    with contextlib.ExitStack() as stack:
        silent = stack.enter_context(silent_port())
        attacker = store_fakes(local, key, [Ed25519PrivateKey.generate() for _ in range(FAKE_KEYS)], silent)
        stack.callback(attacker.shutdown)
        for round in range(3):
            with connected_model(tiny_model_dir, local, verify_probability=1.0, **SPREAD) as model:
                _see_every_server(model, local)
                for i in range(4):
                    ids = _ids(4000 + 10 * round + i)
                    assert (model(ids).logits - _local(reference, ids)).abs().max().item() <= LOGITS_ATOL
                health = manager_of(model).health
                assert not any(health.distrusted(s.peer_id) for s in local.servers if s is not hostile.server)
        assert hostile.count(PERTURBED_LINE) >= 1, "the hostile server was never used"
