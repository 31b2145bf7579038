"""Hostile peers on a real local swarm: malformed, forged and foreign records never reach a client's routes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import hivemind
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time

from swarmlm.swarm.identity import SIGNATURE_MARK, PeerIdSignatureValidator, _signed_bytes
from swarmlm.swarm.records import servers_key
from tests.conftest import LOGITS_ATOL, build_tiny_llama, connected_model, load_reference, running_swarm

PREFIX = "tiny-records"
SPANS = [(0, 2), (2, 5)]


class ForgingValidator(PeerIdSignatureValidator):
    """An attacker's validator: signs every record with its own key and accepts everything."""

    def __init__(self, key: Ed25519PrivateKey):
        super().__init__(key)
        self._key = key

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + SIGNATURE_MARK + self._key.sign(_signed_bytes(record))

    def validate(self, record: DHTRecord) -> bool:
        return True


def _hostile_dht(initial_peers: list[str], validators: list) -> hivemind.DHT:
    return hivemind.DHT(
        initial_peers=initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        start=True,
        record_validators=validators,
        nat_port_map=False,
        auto_nat=False,
        use_relay=False,
        use_auto_relay=False,
    )


def _record(**fields: object) -> dict:
    return {"state": "online", "start": 0, "end": 5, "throughput": 1e9, "dtype": "float32", **fields}


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir)


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The tiny model on two servers, plus a whole other model (same shape, other seed) under the same prefix."""
    other_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-other"), seed=7)
    with running_swarm(tiny_model_dir, SPANS, dht_prefix=PREFIX) as swarm:
        with running_swarm(other_dir, [], dht_prefix=PREFIX) as other:
            other.initial_peers = swarm.initial_peers  # join the first swarm's DHT, not its own
            other.add_server(0, 5)
            swarm.other = other
            yield swarm


def _assert_forward_equals_local(model: torch.nn.Module, reference: torch.nn.Module, seed: int) -> None:
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        expected = reference(ids).logits
    for _ in range(4):  # routes are picked with random tie-breaking: several calls, several chances to go wrong
        assert (model(ids).logits - expected).abs().max().item() <= LOGITS_ATOL


def _real_peers(swarm) -> set[str]:
    return {server.peer_id for server in swarm.servers}


def test_another_model_under_the_same_prefix_is_never_used(tiny_model_dir: Path, reference, swarm) -> None:
    other_peer = swarm.other.servers[0].peer_id
    # the other model's server is announced under the same key: the DHT has it
    found = swarm.dht.get(servers_key(PREFIX), latest=True).value
    assert other_peer in found
    with connected_model(tiny_model_dir, swarm) as model:
        manager = model.model.layers.client.manager
        assert set(manager.servers) == _real_peers(swarm)
        _assert_forward_equals_local(model, reference, seed=1)
        assert not manager.health.has_measured(other_peer)


def test_malformed_records_are_rejected_and_ignored(tiny_model_dir: Path, reference, swarm) -> None:
    hostile = _hostile_dht(swarm.initial_peers, [])  # no validators: it stores and serves anything
    try:
        expiration = get_dht_time() + 600
        key = servers_key(PREFIX)
        own = hostile.peer_id.to_base58()
        hostile.store(key, _record(), expiration, subkey="not-a-peer-id")
        hostile.store(key, _record(addrs=["garbage", "/ip4/999.1.1.1/tcp/x"]), expiration, subkey=own)
        hostile.store(key, b"\x00garbage", expiration, subkey=own + "x")
        # (the attacker's own node may refuse to mix an int subkey with string ones it has seen: no matter)
        with contextlib.suppress(TypeError):
            hostile.store(key, ["not", "a", "record"], expiration, subkey=12345)
        hostile.store(key, "a plain value to replace the dictionary", expiration + 600)
        # honest nodes (the bootstrap node and the servers) refused all of it
        stored = swarm.dht.get(key, latest=True).value
        assert isinstance(stored, dict) and set(stored) <= _real_peers(swarm) | {swarm.other.servers[0].peer_id}
        with connected_model(tiny_model_dir, swarm) as model:
            assert set(model.model.layers.client.manager.servers) == _real_peers(swarm)
            _assert_forward_equals_local(model, reference, seed=2)
    finally:
        hostile.shutdown()


def test_nobody_else_can_take_a_server_offline(tiny_model_dir: Path, reference, swarm) -> None:
    victim = swarm.servers[0].peer_id
    key = servers_key(PREFIX)
    unsigned = _hostile_dht(swarm.initial_peers, [])
    forger = _hostile_dht(swarm.initial_peers, [ForgingValidator(Ed25519PrivateKey.generate())])
    try:
        offline = _record(state="offline", start=0, end=2)
        for attacker in (unsigned, forger):
            attacker.store(key, offline, get_dht_time() + 3600, subkey=victim)
        # the honest nodes kept the victim's own record
        assert swarm.dht.get(key, latest=True).value[victim].value["state"] == "online"
        with connected_model(tiny_model_dir, swarm, swarm_refresh_interval_s=0.5) as model:
            manager = model.model.layers.client.manager
            time.sleep(1.5)  # a few background refreshes, each meeting the attackers' copies
            assert victim in manager.servers
            _assert_forward_equals_local(model, reference, seed=3)
            assert manager.health.has_measured(victim)  # the only server of blocks 0:2 is still routed to
    finally:
        unsigned.shutdown()
        forger.shutdown()


def test_records_carry_identity_and_limits(swarm) -> None:
    found = swarm.dht.get(servers_key(PREFIX), latest=True).value
    record = found[swarm.servers[0].peer_id].value
    assert len(record["fingerprint"]) == 32 and record["version"]
    assert record["max_tokens_per_request"] > 0 and record["cache_tokens_total"] > 0
    assert record["cache_tokens_left"] == record["cache_tokens_total"]
    assert found[swarm.other.servers[0].peer_id].value["fingerprint"] != record["fingerprint"]
    assert record["inference_throughput"] > 0


def test_server_info_describes_each_server_as_it_is_now(tiny_model_dir: Path, swarm) -> None:
    with connected_model(tiny_model_dir, swarm) as model:
        infos = model.server_infos()
        assert set(infos) == _real_peers(swarm)  # the other model's server is not this model's
        first = infos[swarm.servers[0].peer_id]
        assert (first.start_block, first.end_block) == SPANS[0]
        assert first.fingerprint == model.model.layers.client.manager.view.filter.fingerprint
        assert first.version and first.dtype == "float32" and first.max_position == 256
        assert first.throughput > 0 and first.inference_throughput > 0
        assert first.cache_tokens_left == first.cache_tokens_total and first.sessions_open == 0
        with model.inference_session(max_length=16) as session:
            session.step(torch.randn(2, 3, 64))
            busy = model.server_info(swarm.servers[0].peer_id)
            assert busy.sessions_open == 1
            # block-tokens: batch 2 x max_length 16 at each of the server's blocks 0:2
            assert busy.cache_tokens_left == busy.cache_tokens_total - 2 * 16 * 2
        assert model.server_info(swarm.servers[0].peer_id).sessions_open == 0
