"""A private swarm on real processes: its bootstrap node and server hold a swarm key; a client with the key uses it
like any swarm, while a peer without it cannot read or write its DHT records nor call its server."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.api.service import MONITOR_READY_LINE
from swarmlm.api.status import STATUS_NO_MODEL
from swarmlm.client.loop import LoopThread
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.span_call import Expected, call_span
from swarmlm.config import ClientConfig
from swarmlm.errors import BadRequestError, MissingBlocksError, RemoteCallError, SwarmError
from swarmlm.models.naming import default_dht_prefix
from swarmlm.protocol.messages import ForwardRequest
from swarmlm.swarm.dht import start_dht
from swarmlm.swarm.private import OUTSIDER_REFUSAL, blind_prefix, generate_swarm_key, load_swarm_key
from swarmlm.swarm.records import ServerRecord, ServerState, announce, fetch_servers, servers_key
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm
from tests.integration.http_process import SWARMLM, http_process, run_command

IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("private") / "swarm.key"
    generate_swarm_key(path)
    return path


@pytest.fixture(scope="module")
def private(tiny_model_dir: Path, key_file: Path) -> Iterator[LocalSwarm]:
    with running_swarm(tiny_model_dir, [(0, 5)], swarm_key_file=str(key_file)) as swarm:
        yield swarm


def _prefix(swarm: LocalSwarm, key_file: Path) -> str:
    """The DHT prefix of the private swarm: what an outsider would need to know (it cannot compute it)."""
    return blind_prefix(swarm.dht_prefix or default_dht_prefix(swarm.model), load_swarm_key(key_file))


def test_a_member_uses_the_private_swarm(tiny_model_dir: Path, key_file: Path, private: LocalSwarm) -> None:
    with torch.inference_mode():
        expected = load_reference(tiny_model_dir)(IDS).logits
    with connected_model(tiny_model_dir, private, swarm_key=key_file) as model:
        assert (model(IDS).logits - expected).abs().max().item() <= LOGITS_ATOL


def test_an_outsider_finds_no_server(tiny_model_dir: Path, private: LocalSwarm) -> None:
    with connected_model(tiny_model_dir, private, missing_blocks_timeout_s=2.0) as model:
        with pytest.raises(MissingBlocksError):
            model(IDS)


def test_an_outsider_cannot_read_or_write_records(key_file: Path, private: LocalSwarm) -> None:
    prefix = _prefix(private, key_file)  # the worst case: the outsider learned the blinded name
    outsider = start_dht(private.initial_peers, host="127.0.0.1")
    try:
        found = outsider.get(servers_key(prefix), latest=True)
        entries = {} if found is None or not isinstance(found.value, dict) else found.value
        for entry in entries.values():  # at most ciphertext: no field of a record is readable
            assert isinstance(entry.value, bytes) and b"throughput" not in entry.value
        assert asyncio.run(fetch_servers(outsider, prefix)) == {}
        # its own record (signed by its own peer id, so only the swarm key is missing) is dropped by members
        record = ServerRecord(state=ServerState.ONLINE, start=0, end=5, throughput=1e9, dtype="float32")
        outsider_id = outsider.peer_id.to_base58()
        asyncio.run(announce(outsider, prefix, outsider_id, record, ttl_s=60))
        members_see = asyncio.run(fetch_servers(private.dht, prefix))
        assert set(members_see) == {private.servers[0].peer_id}
    finally:
        outsider.shutdown()


def _call_directly(tiny_model_dir: Path, swarm: LocalSwarm, key_file: Path, swarm_key: bytes | None) -> None:
    """Call the server's rpc_forward the way a client would, having learned its record somehow."""
    prefix = _prefix(swarm, key_file)
    records = asyncio.run(fetch_servers(swarm.dht, prefix))
    config = ClientConfig(initial_peers=tuple(swarm.initial_peers), request_timeout_s=10.0, swarm_key=swarm_key)
    loop = LoopThread()
    manager = SequenceManager(config, "any-name", 5)
    try:
        loop.run(manager.start())
        manager.view.servers = dict(records)  # as if it had read them
        peer = next(iter(records))
        hidden = torch.randn(1, 3, 64)
        header = ForwardRequest(start_block=0, end_block=5)
        loop.run(call_span(manager, peer, "rpc_forward", header, [hidden], {"hidden": Expected.like(hidden)}))
    finally:
        loop.run(manager.close(), timeout=30)
        loop.close()


def test_an_outsider_cannot_call_the_server(tiny_model_dir: Path, key_file: Path, private: LocalSwarm) -> None:
    with pytest.raises(BadRequestError, match=OUTSIDER_REFUSAL):
        _call_directly(tiny_model_dir, private, key_file, swarm_key=None)
    with pytest.raises(RemoteCallError, match="refused this client's swarm key"):
        _call_directly(tiny_model_dir, private, key_file, swarm_key=bytes(32))
    _call_directly(tiny_model_dir, private, key_file, swarm_key=load_swarm_key(key_file))  # a member may


def test_a_bad_key_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "swarm.key"
    bad.write_text("not a key\n")
    with pytest.raises(SwarmError, match="is not a swarm key"):
        load_swarm_key(bad)


def test_status_and_monitor_see_the_private_swarm_with_its_key_only(key_file: Path, private: LocalSwarm) -> None:
    command = [*SWARMLM, "status", "--initial-peers", *private.initial_peers]
    member = run_command([*command, "--swarm-key", str(key_file)], timeout=120)
    assert member.returncode == 0, member.stdout + member.stderr
    assert "5 blocks, complete" in member.stdout and "online" in member.stdout  # its server answered the probe
    outsider = run_command(command, timeout=120)
    assert outsider.returncode == STATUS_NO_MODEL and "No model is served" in outsider.stdout, outsider.stderr
    args = ["monitor", "--port", "0", "--initial-peers", *private.initial_peers, "--swarm-key", str(key_file)]
    with http_process(args, MONITOR_READY_LINE) as url:
        with urllib.request.urlopen(f"{url}/api/v1/swarm", timeout=30) as response:
            (model,) = json.loads(response.read())["models"]
    assert model["complete"] and [server["state"] for server in model["servers"]] == ["online"]
