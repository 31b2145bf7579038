"""Peer addresses for tests: one of a peer that is not there."""

from __future__ import annotations

import socket

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import PeerID

from swarmlm.swarm.identity import peer_id_bytes


def dead_peer() -> str:
    """The multiaddr of a peer that is not there: a port nobody listens on, a peer id nobody holds."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{PeerID(peer_id_bytes(Ed25519PrivateKey.generate())).to_base58()}"
