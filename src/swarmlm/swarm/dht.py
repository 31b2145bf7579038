"""Starting DHT nodes that never outlive their parent, and the multiaddr helpers around them."""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
from collections.abc import Sequence

import hivemind
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils.multiaddr import Multiaddr

from swarmlm.errors import SwarmError
from swarmlm.swarm.identity import PeerIdSignatureValidator, temporary_identity_file
from swarmlm.swarm.private import SwarmKeyValidator
from swarmlm.utils.processes import kill_group_when_orphaned

logger = logging.getLogger(__name__)


class ParentBoundDHT(hivemind.DHT):
    """A hivemind DHT whose background process (and its p2pd) is killed when the creating process dies.

    hivemind's DHT child and its p2pd survive a SIGTERM/SIGKILL of the parent; this one does not.
    """

    def run(self) -> None:  # runs in the forked child
        kill_group_when_orphaned(self._bound_parent_pid)
        super().run()


def is_loopback_maddr(maddr: str) -> bool:
    parts = str(maddr).split("/")
    try:
        return len(parts) > 2 and parts[1] in ("ip4", "ip6") and ipaddress.ip_address(parts[2]).is_loopback
    except ValueError:
        return False


def start_dht(
    initial_peers: Sequence[str] = (),
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    client_mode: bool = False,
    swarm_key: bytes | None = None,
    key: Ed25519PrivateKey | None = None,
    announce_maddrs: Sequence[str] = (),
    nat_traversal: bool | None = None,
) -> ParentBoundDHT:
    """Start a DHT node; on a loopback host (or with nat_traversal=False) the NAT traversal and relay machinery of
    p2pd is turned off.

    The node has the Ed25519 identity `key` (default: a fresh one) and validates every record it stores or reads:
    only the owner of a peer id may write that peer id's entry (see swarm/identity.py). With swarm_key, it also
    stores and accepts only records encrypted with that key (see swarm/private.py). announce_maddrs: the addresses
    others should dial instead of the listening ones (a port forward, a proxy in front of this node).
    """
    ip = "ip6" if ":" in host else "ip4"
    kwargs: dict[str, object] = {}
    traversal = not _is_loopback_host(host) if nat_traversal is None else nat_traversal
    if not traversal:
        kwargs = dict(nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    key = key or Ed25519PrivateKey.generate()
    identity_path = temporary_identity_file(key)
    try:
        dht = ParentBoundDHT(
            initial_peers=list(initial_peers),
            host_maddrs=[f"/{ip}/{host}/tcp/{port}"],
            client_mode=client_mode,
            start=False,
            record_validators=[PeerIdSignatureValidator(key)] + ([SwarmKeyValidator(swarm_key)] if swarm_key else []),
            identity_path=str(identity_path),
            # hivemind's "is this identity taken" check parses RSA keys only; a fresh random key is never taken
            check_if_identity_free=False,
            **kwargs,
        )
        dht._bound_parent_pid = os.getpid()
        dht.run_in_background(await_ready=True)
    finally:
        # p2pd has read the key once it runs; the key stays only in this process and the DHT's
        shutil.rmtree(identity_path.parent, ignore_errors=True)
    return dht


def check_announce_maddrs(maddrs: Sequence[str]) -> None:
    """Raise SwarmError unless every address is a multiaddr with an explicit TCP or UDP port."""
    for maddr in maddrs:
        try:
            parsed = Multiaddr(maddr)
        except Exception as e:  # noqa: BLE001 - the multiaddr parser raises assorted types for malformed text
            raise SwarmError(f"--announce-maddrs: {maddr!r} is not a multiaddr: {e}") from e
        protocols = {p.name for p in parsed.protocols()}
        port = next((parsed.value_for_protocol(p) for p in ("tcp", "udp") if p in protocols), None)
        if port in (None, "0"):
            raise SwarmError(f"--announce-maddrs: {maddr!r} needs an explicit port, as in /ip4/203.0.113.7/tcp/31337")


def _is_loopback_host(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(addr) for addr in dht.get_visible_maddrs()]
