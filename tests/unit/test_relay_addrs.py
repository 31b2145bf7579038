"""Relay addresses: what `serve --relay` accepts, and how relayed addresses are encoded for p2pd."""

from __future__ import annotations

import pytest
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarmlm.cli.main import build_parser
from swarmlm.errors import SwarmError
from swarmlm.net.dialing import daemon_maddr
from swarmlm.swarm.dht import check_relay_maddrs, relay_circuit

RELAY_ID = "12D3KooWAprJCTq9UZSyFbdcHkRwUb8xbctt8xvsoFvk3CRH3p6D"
SERVER_ID = "12D3KooWJuPB1q33jsiZZKWsPXQBSbGR3ETp5X8EhNMLiSTbmqk8"
RELAY = f"/ip4/203.0.113.7/tcp/31337/p2p/{RELAY_ID}"


def test_a_relay_needs_a_port_and_its_peer_id() -> None:
    check_relay_maddrs([RELAY])
    for bad in ["/ip4/203.0.113.7/tcp/31337", f"/ip4/203.0.113.7/tcp/0/p2p/{RELAY_ID}", f"/ip4/1.2.3.4/p2p/{RELAY_ID}",
                "/ip4/203.0.113.7/tcp/31337/p2p/xyz", f"{RELAY}/p2p-circuit", "not an address"]:  # fmt: skip
        with pytest.raises(SwarmError, match="--relay"):
            check_relay_maddrs([bad])


def test_relayed_addresses_carry_the_relay_id_as_a_raw_peer_id() -> None:
    encoded = daemon_maddr(f"{relay_circuit(RELAY)}/p2p/{SERVER_ID}").to_bytes()
    relay_id = PeerID.from_base58(RELAY_ID).to_bytes()
    head = Multiaddr("/ip4/203.0.113.7/tcp/31337").to_bytes()
    # /ip4/../tcp/.. then p2p (421 = a5 03), the multihash's length and bytes, then p2p-circuit (290 = a2 02);
    # the dialled server's own id is not part of the address
    assert encoded == head + bytes([0xA5, 0x03, len(relay_id)]) + relay_id + bytes([0xA2, 0x02])


def test_plain_addresses_lose_only_the_trailing_peer_id() -> None:
    assert daemon_maddr(f"/ip4/10.0.0.1/tcp/5/p2p/{SERVER_ID}") == Multiaddr("/ip4/10.0.0.1/tcp/5")
    assert daemon_maddr("/ip4/10.0.0.1/tcp/5") == Multiaddr("/ip4/10.0.0.1/tcp/5")


def test_the_cli_maps_relay_flags() -> None:
    args = build_parser().parse_args(["serve", "m", "--blocks", "0:2", "--relay", RELAY])
    assert args.relay == [RELAY]
    assert build_parser().parse_args(["dht"]).no_relay is False
    assert build_parser().parse_args(["dht", "--no-relay"]).no_relay is True
