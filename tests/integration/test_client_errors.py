"""A client whose initial peers are all dead gets UnreachablePeersError saying what to check, and a node that cannot
start (a taken port, an address p2pd cannot parse) a SwarmError with p2pd's reason; neither leaves a process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmlm.errors import SwarmError, UnreachablePeersError
from swarmlm.swarm.dht import ParentBoundDHT, start_dht, visible_maddrs
from tests.addresses import dead_peer
from tests.conftest import descendants


@pytest.fixture(scope="module")
def node() -> Iterator[ParentBoundDHT]:
    node = start_dht(host="127.0.0.1", nat_traversal=False)
    try:
        yield node
    finally:
        node.shutdown()


def test_from_pretrained_with_only_dead_peers_says_what_to_check(tiny_model_dir: Path) -> None:
    from swarmlm import AutoDistributedModelForCausalLM

    peers = [dead_peer(), dead_peer()]
    before = {process.pid for process in descendants()}
    with pytest.raises(UnreachablePeersError) as caught:
        AutoDistributedModelForCausalLM.from_pretrained(tiny_model_dir, initial_peers=peers)
    message = str(caught.value)
    assert message.startswith("none of the initial peers answered (3 tries in ")
    assert all(peer in message for peer in peers) and "Check that they are running" in message
    assert {process.pid for process in descendants()} == before  # the DHT process and its p2pd are gone


def test_a_node_refuses_a_port_another_p2pd_listens_on(node: ParentBoundDHT) -> None:
    port = int(visible_maddrs(node)[0].split("/")[4])
    before = {process.pid for process in descendants()}
    for host in ("127.0.0.1", "0.0.0.0"):  # p2pd would bind beside the first one on either (SO_REUSEPORT)
        with pytest.raises(SwarmError, match=f"port {port}: the port is already in use on {host}"):
            start_dht(host=host, port=port)
    assert {process.pid for process in descendants()} == before


def test_a_peer_address_p2pd_cannot_parse_is_refused_with_its_reason(node: ParentBoundDHT) -> None:
    before = {process.pid for process in descendants()}
    peer = visible_maddrs(node)[0].split("/p2p/")[1]
    with pytest.raises(SwarmError, match=r"p2pd\) did not start: failed to parse multiaddr .*failed to parse ip4"):
        start_dht([f"/ip4/127.0.0.300/tcp/1/p2p/{peer}"], host="127.0.0.1")
    assert {process.pid for process in descendants()} == before
