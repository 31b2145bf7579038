"""Dialing a peer at its announced addresses: telling our p2pd where it listens, in the daemon's own encoding."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

# multiaddr protocol codes (github.com/multiformats/multiaddr, protocols.csv)
_P2P_CODE = 421
_CIRCUIT_CODE = 290


async def dial(p2p: P2P, peer: PeerID, addrs: list[str], timeout_s: float) -> None:
    """Tell our p2pd where a server listens, so the first call need not wait for the DHT to have met it; TimeoutError
    when the daemon has not connected within timeout_s.

    hivemind has no public connect(); its own code calls the daemon client (the private `_client`) the same way.
    The daemon wants addresses without the trailing /p2p/<peer id>, and relayed ones encoded its way (daemon_maddr).
    """
    async with asyncio.timeout(timeout_s):
        await p2p._client.connect(peer, [daemon_maddr(addr) for addr in addrs])


class Dialer:
    """Dials each peer once, before the first call to it; a peer forgotten (its calls failed) is dialled again."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s  # the deadline of each dial
        self._dialed: set[str] = set()  # peer ids (base58)

    async def ensure_connected(self, p2p: P2P, peer: PeerID, addrs: Sequence[str]) -> None:
        """Dial `peer` at `addrs` unless it was dialled already (or no address is known: the DHT may know it)."""
        peer_id = peer.to_base58()
        if peer_id not in self._dialed and addrs:
            await dial(p2p, peer, list(addrs), self.timeout_s)
            self._dialed.add(peer_id)

    def dialed(self, peer_id: str) -> bool:
        return peer_id in self._dialed

    def forget(self, peer_id: str) -> None:
        self._dialed.discard(peer_id)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def daemon_maddr(maddr: str) -> Multiaddr:
    """A multiaddr as p2pd reads it, for dialling: transport parts as they are, /p2p/<id> parts as the raw peer id.

    hivemind's Multiaddr encodes a /p2p/ part as a CID, which p2pd rejects ("length greater than remaining number of
    bytes"); relayed addresses (.../p2p/<relay>/p2p-circuit) need that part, so they are encoded here by hand. A
    trailing /p2p/<id> (the dialled peer itself) is dropped: p2pd takes the peer id separately.
    """
    parts = str(maddr).split("/p2p/")
    if len(parts) > 1 and "/" not in parts[-1]:
        parts[-2:] = [parts[-2]]  # the peer's own id
    encoded = bytearray(Multiaddr(parts[0]).to_bytes()) if parts[0] else bytearray()
    for part in parts[1:]:
        peer, _, rest = part.partition("/")
        peer_bytes = PeerID.from_base58(peer).to_bytes()
        encoded += _varint(_P2P_CODE) + _varint(len(peer_bytes)) + peer_bytes
        if rest == "p2p-circuit":
            encoded += _varint(_CIRCUIT_CODE)
        elif rest:
            encoded += Multiaddr("/" + rest).to_bytes()
    return Multiaddr(bytes(encoded))
