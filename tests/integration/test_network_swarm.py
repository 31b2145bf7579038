"""A swarm over emulated hosts (swarmlm.tools.netbed): every server on a host of its own behind a delaying link, the
client on another. Generation equals a local run across 50 ms links (also with steps pushed server to server, and
with speculative decoding), also when a server is SIGKILLed mid-generation, and through a server behind NAT that is
reached only through the bootstrap node's relay; the client routes through the nearer of two replicas from its first
request on."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm import AutoDistributedModelForCausalLM
from swarmlm.tools.local_swarm import LocalServer
from swarmlm.tools.netbed import hosts
from swarmlm.tools.netbed.swarm import SERVER_PORT, Link, NetSwarm
from tests.conftest import load_reference
from tests.integration.test_push import local_greedy, pushes

pytestmark = pytest.mark.skipif(hosts.unavailable() is not None, reason=str(hosts.unavailable()))

WAN = Link(delay_ms=50)  # one-way delay of each server's link in the generation tests
NEAR, FAR = Link(delay_ms=5), Link(delay_ms=100)
NAT = Link(behind_nat=True)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[NetSwarm]:
    spans = [(0, 3), (3, 5), (3, 5), (0, 5), (0, 5), (0, 5)]
    with NetSwarm(str(tiny_model_dir), max_servers=len(spans), threads_per_server=1) as swarm:
        swarm.start_servers(spans, [WAN, WAN, WAN, NEAR, FAR, NAT])
        yield swarm
        bed = swarm.bed
    assert bed.leftovers() == []  # every namespace and link of the bed is gone


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir)


def connect(swarm: NetSwarm, model_dir: Path, servers: list[LocalServer], **options: object) -> torch.nn.Module:
    with swarm.client_side():
        return AutoDistributedModelForCausalLM.from_pretrained(
            str(model_dir), initial_peers=swarm.initial_peers, request_timeout_s=30.0, ban_base_s=0.5,
            allowed_servers=tuple(str(s.peer_id) for s in servers), **options,
        )  # fmt: skip


class KillAfter:
    """A streamer that SIGKILLs the server the active session uses for `block` once `count` tokens came out."""

    def __init__(self, model: torch.nn.Module, swarm: NetSwarm, count: int, block: int):
        self.model, self.swarm, self.count, self.block, self.seen, self.killed = model, swarm, count, block, -1, ""

    def put(self, value: torch.Tensor) -> None:
        self.seen += 1  # the first call carries the prompt
        if self.seen == self.count:
            spans = self.model.active_session.route
            self.killed = next(s.peer_id for s in spans if s.start <= self.block < s.end)
            self.swarm.kill(next(server for server in self.swarm.servers if server.peer_id == self.killed))

    def end(self) -> None:
        pass


def test_servers_announce_the_address_of_their_link(swarm: NetSwarm, tiny_model_dir: Path) -> None:
    model = connect(swarm, tiny_model_dir, swarm.servers)
    try:
        records = model.model.layers.client.manager.servers
        for index, server in enumerate(swarm.servers[:5]):  # the last one is behind NAT
            address = swarm.bed.hosts[index + 1].address
            assert [a.split("/p2p/")[0] for a in records[str(server.peer_id)].addrs] == [
                f"/ip4/{address}/tcp/{SERVER_PORT}"
            ]
    finally:
        model.close()


def test_greedy_generation_over_50ms_links_equals_local(swarm: NetSwarm, tiny_model_dir: Path, reference) -> None:
    ids = torch.tensor([[5, 17, 3, 99, 42, 8]])
    model = connect(swarm, tiny_model_dir, swarm.servers[:2], use_push=False)  # 3 hosts: 2 servers and the client
    try:
        began = time.perf_counter()
        output = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert output[0].tolist() == local_greedy(reference, ids, NEW_TOKENS)
        # each of the 2 hops of every token crossed a 50 ms link twice: the emulated delay is real
        assert time.perf_counter() - began >= NEW_TOKENS * 2 * 0.1
    finally:
        model.close()


def test_pushed_generation_over_50ms_links_equals_local(swarm: NetSwarm, tiny_model_dir: Path, reference) -> None:
    ids = torch.tensor([[5, 17, 3, 99, 42, 8]])
    model = connect(swarm, tiny_model_dir, swarm.servers[:2], use_push=True)
    try:
        before = pushes(model)
        output = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert output[0].tolist() == local_greedy(reference, ids, NEW_TOKENS)
        # every step reached the second server from the first one (across its 50 ms link), not from the client
        assert pushes(model) - before >= NEW_TOKENS
    finally:
        model.close()


def test_speculative_generation_over_50ms_links_equals_greedy(
    swarm: NetSwarm, tiny_model_dir: Path, reference: torch.nn.Module
) -> None:
    ids = torch.tensor([[7, 8, 9, 7, 8, 9, 7, 8]])  # a repeating prompt: prompt lookup has drafts to propose
    model = connect(swarm, tiny_model_dir, swarm.servers[:2])
    try:
        output = model.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=4
        )
        assert output[0].tolist() == local_greedy(reference, ids, NEW_TOKENS)
    finally:
        model.close()


def test_a_server_sigkilled_mid_generation_changes_nothing(swarm: NetSwarm, tiny_model_dir: Path, reference) -> None:
    ids = torch.tensor([[7, 1, 64, 2, 90]])
    expected = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    model = connect(swarm, tiny_model_dir, swarm.servers[:3])  # blocks 3:5 have a replica
    try:
        streamer = KillAfter(model, swarm, count=4, block=3)
        output = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, streamer=streamer)
        assert output.tolist() == expected.tolist()
        assert streamer.killed and model.model.layers.client.manager.health.failed(streamer.killed)
    finally:
        model.close()


def test_routes_use_the_near_replica_from_the_first_request(swarm: NetSwarm, tiny_model_dir: Path) -> None:
    near, far = swarm.servers[3], swarm.servers[4]
    # routing alone: no spot checks (they re-run requests on the other replica) and no exploration. The latency
    # policy (that of inference sessions) is the one where distance decides: under the throughput policy of batch
    # work a replica that announced twice the throughput rightly wins, and six servers measuring themselves at once
    # on two cores announce figures that differ that much
    model = connect(swarm, tiny_model_dir, [near, far], verify_probability=0.0, verify_first_requests=0,
                    explore_interval_s=0, routing="latency")  # fmt: skip
    try:
        manager = model.model.layers.client.manager
        for _ in range(5):
            model(torch.tensor([[1, 2, 3]]))
        (near_rtt, _), (far_rtt, _) = (manager.health.measured(str(s.peer_id), 1.0) for s in (near, far))
        assert near_rtt < far_rtt and far_rtt >= 0.2  # 100 ms each way
        # the far replica was only pinged (a timed rpc_info), never asked to compute
        assert manager.health.has_measured(str(near.peer_id)) and not manager.health.has_measured(str(far.peer_id))
    finally:
        model.close()


def test_a_server_behind_nat_is_used_through_the_relay(swarm: NetSwarm, tiny_model_dir: Path, reference) -> None:
    hidden, host = swarm.servers[5], swarm.bed.hosts[6]
    with swarm.client_side(), pytest.raises(ConnectionRefusedError):
        socket.create_connection((host.address, SERVER_PORT), timeout=5).close()  # nothing there accepts connections
    ids = torch.tensor([[9, 4, 33, 70, 2]])
    expected = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    model = connect(swarm, tiny_model_dir, [hidden])
    try:
        relay = swarm.initial_peers[0]
        addrs = model.model.layers.client.manager.servers[str(hidden.peer_id)].addrs
        assert list(addrs) == [f"{relay}/p2p-circuit/p2p/{hidden.peer_id}"]  # dialled only through the relay
        output = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert output.tolist() == expected.tolist()
        assert model.last_trace.servers == [str(hidden.peer_id)]
    finally:
        model.close()
