"""Starting DHT nodes that never outlive their parent, and the multiaddr helpers around them."""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import hivemind
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2PDaemonError
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from swarmlm.checks import check_can_listen, check_ip_host, check_peer_maddrs
from swarmlm.errors import SwarmError, UnreachablePeersError
from swarmlm.net.patches import use_only_static_relays
from swarmlm.swarm.identity import PeerIdSignatureValidator, temporary_identity_file
from swarmlm.swarm.private import SwarmKeyValidator
from swarmlm.swarm.reconnect import RECONNECT_INTERVAL_S, start_reconnecting
from swarmlm.utils.processes import kill_group_when_orphaned

logger = logging.getLogger(__name__)

# starting a node whose initial peers do not answer is tried this many times, waiting BOOTSTRAP_RETRY_S x attempt
# in between; p2pd's own error for it contains BOOTSTRAP_FAILURE
BOOTSTRAP_ATTEMPTS = 3
BOOTSTRAP_RETRY_S = 2.0
BOOTSTRAP_FAILURE = "failed to connect to bootstrap peers"
# how hivemind words a p2pd that exits at start: "Daemon failed to start: 2026/01/02 10:11:12 <what p2pd said>"
_DAEMON_PREFIX = re.compile(r"^Daemon failed to start:\s*(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\s*)?")


class ParentBoundDHT(hivemind.DHT):
    """A hivemind DHT whose background process (and its p2pd) is killed when the creating process dies.

    hivemind's DHT child and its p2pd survive a SIGTERM/SIGKILL of the parent; this one does not.
    """

    _bound_parent_pid: int
    _static_relays: bool = False

    def run(self) -> None:  # runs in the forked child
        kill_group_when_orphaned(self._bound_parent_pid)
        if self._static_relays:
            use_only_static_relays()
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
    relays: Sequence[str] = (),
    relay_service: bool = False,
    may_start_alone: bool = False,
    reconnect_interval_s: float = RECONNECT_INTERVAL_S,
    peers_file: Path | None = None,
) -> ParentBoundDHT:
    """Start a DHT node; on a loopback host (or with nat_traversal=False) the NAT traversal and relay machinery of
    p2pd is turned off.

    The node has the Ed25519 identity `key` (default: a fresh one) and validates every record it stores or reads:
    only the owner of a peer id may write that peer id's entry (see swarm/identity.py). With swarm_key, it also
    stores and accepts only records encrypted with that key (see swarm/private.py). announce_maddrs: the addresses
    others should dial instead of the listening ones (a port forward, a proxy in front of this node).

    relays: full multiaddrs (.../p2p/<peer id>) of relay nodes for a node that accepts no inbound connections (behind
    NAT or a firewall): it keeps a reservation on each and is dialled through them (relay_circuit), in addition to
    announce_maddrs. relay_service: this node relays for such nodes (it must itself be reachable by everyone).

    may_start_alone (the first node of a swarm, `--new-swarm`): start even when no initial peer answers. Every
    reconnect_interval_s (0: never), the node dials again its initial peers and the peers it has met that are missing
    from its routing table (swarm/reconnect.py): a restart, of this node or of another, does not split the swarm.
    peers_file: where the node keeps the peers it met, and finds those of its previous run to dial at once.
    """
    check_peer_maddrs(initial_peers, "initial peers")
    check_ip_host(host, "host")
    check_can_listen(host, port, "port", "host")  # p2pd would share a taken port (see check_can_listen)
    ip = "ip6" if ":" in host else "ip4"
    kwargs: dict[str, object] = {}
    traversal = not _is_loopback_host(host) if nat_traversal is None else nat_traversal
    if not traversal:
        kwargs = dict(nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
    if relay_service:
        # p2pd serves relay reservations only while it believes itself publicly reachable
        kwargs.update(use_relay=True, force_reachability="public")
    if relays:
        check_relay_maddrs(relays)
        kwargs.update(use_relay=True, use_auto_relay=True, trusted_relays=list(relays), force_reachability="private")
        announce_maddrs = [*announce_maddrs, *(relay_circuit(relay) for relay in relays)]
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    key = key or Ed25519PrivateKey.generate()
    identity_path = temporary_identity_file(key)

    def make(peers: Sequence[str]) -> ParentBoundDHT:
        dht = ParentBoundDHT(
            initial_peers=list(peers),
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
        dht._static_relays = bool(relays)
        return dht

    try:
        dht = _start_joined(make, initial_peers, may_start_alone)
    finally:
        # p2pd has read the key once it runs; the key stays only in this process and the DHT's
        shutil.rmtree(identity_path.parent, ignore_errors=True)
    if reconnect_interval_s > 0:
        try:
            start_reconnecting(dht, initial_peers, reconnect_interval_s, peers_file)
        except BaseException:
            dht.shutdown()
            raise
    return dht


def _start_joined(
    make: Callable[[Sequence[str]], ParentBoundDHT], initial_peers: Sequence[str], may_start_alone: bool = False
) -> ParentBoundDHT:
    """Start a node made by `make`, again a few times while no initial peer answers; raise SwarmError (its subclass
    UnreachablePeersError when no peer ever answered) with nothing left running when it does not start. With
    may_start_alone, a node whose initial peers do not answer at the first try starts without them (it dials them
    again later)."""
    began, attempt = time.monotonic(), 1
    while True:
        dht = make(initial_peers)
        try:
            dht.run_in_background(await_ready=True)
            return dht
        except P2PDaemonError as e:
            _stop_failed(dht)
            reason = _daemon_reason(e)
            if not bootstrap_failed(reason, initial_peers):
                raise SwarmError(f"the p2p daemon (p2pd) did not start: {reason}") from e
            if may_start_alone:
                logger.warning("No initial peer answered; starting alone (they are dialled again later)")
                return _start_joined(make, (), False)
            if attempt == BOOTSTRAP_ATTEMPTS:
                raise UnreachablePeersError(
                    f"none of the initial peers answered ({attempt} tries in {time.monotonic() - began:.0f} s): "
                    f"{' '.join(initial_peers)}. Check that they are running, that the addresses are current (a "
                    "restarted node has a new port unless given --port, and a new peer id unless given --identity), "
                    "and that this machine can reach them"
                ) from e
        # p2pd gives up when no initial peer answers within its own timeout: one that is restarting, or slow to
        # accept under load, is tried again a few times before this node gives up too
        logger.warning("No initial peer answered (attempt %d of %d); trying again in %.0f s",
                       attempt, BOOTSTRAP_ATTEMPTS, BOOTSTRAP_RETRY_S * attempt)  # fmt: skip
        time.sleep(BOOTSTRAP_RETRY_S * attempt)
        attempt += 1


def _stop_failed(dht: ParentBoundDHT) -> None:
    """Wait for the child of a node that did not start to exit, or end it (ParentBoundDHT's SIGTERM takes its whole
    process group, p2pd included)."""
    dht.join(timeout=5)
    if dht.is_alive():
        dht.terminate()
        dht.join(timeout=5)


def bootstrap_failed(reason: str, initial_peers: Sequence[str]) -> bool:
    """Whether p2pd exited because no initial peer answered. hivemind reports p2pd's last line of output, and the
    fatal line can be followed by a log line of another of p2pd's goroutines (seen on a loaded machine): with
    initial peers to join, such a line is read as the bootstrap failure it nearly always hides (the node is started
    again; a different fatal error shows itself then)."""
    if BOOTSTRAP_FAILURE in reason:
        return True
    return bool(initial_peers) and reason.startswith("{") and '"logger"' in reason


def _daemon_reason(error: P2PDaemonError) -> str:
    """p2pd's own words from hivemind's error, without the prefix and p2pd's timestamp."""
    return _DAEMON_PREFIX.sub("", str(error)).strip()


def check_announce_maddrs(maddrs: Sequence[str], flag: str = "--announce-maddrs") -> None:
    """Raise SwarmError unless every address is a multiaddr with an explicit TCP or UDP port."""
    for maddr in maddrs:
        try:
            parsed = Multiaddr(maddr)
        except Exception as e:  # the multiaddr parser raises assorted types for malformed text
            raise SwarmError(f"{flag}: {maddr!r} is not a multiaddr: {e}") from e
        protocols = {p.name for p in parsed.protocols()}
        port = next((parsed.value_for_protocol(p) for p in ("tcp", "udp") if p in protocols), None)
        if port in (None, "0"):
            raise SwarmError(f"{flag}: {maddr!r} needs an explicit port, as in /ip4/203.0.113.7/tcp/31337")


def check_relay_maddrs(maddrs: Sequence[str]) -> None:
    """Raise SwarmError unless every relay address is a peer's multiaddr (ending with the relay's /p2p/<peer id>)
    with an explicit port, and not itself a relayed address."""
    check_peer_maddrs(maddrs, "--relay")
    for maddr in maddrs:
        if "p2p-circuit" in maddr:
            raise SwarmError(f"--relay: {maddr!r} is a relayed address; give the relay's own, as in "
                             "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...")  # fmt: skip
        check_announce_maddrs([maddr], "--relay")  # also parses the transport parts and the peer id


def relay_circuit(relay: str) -> str:
    """The address through which a node holding a reservation on `relay` is dialled (append /p2p/<its peer id>)."""
    return f"{relay}/p2p-circuit"


def _is_loopback_host(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def store_subkey(dht: hivemind.DHT, key: str, subkey: str, value: object, ttl_s: float) -> str | None:
    """Store `value` under `key`'s `subkey` for ttl_s; None once the DHT holds it, else what failed and why.

    hivemind's answer to a store is that of the replica that answered last: one replica that refuses (a rogue node,
    one holding a later-dated value under the key) fails a store the others took. So a failed store is checked by
    reading the key back, and only a value the DHT does not give back is a failure."""
    expiration = get_dht_time() + ttl_s
    if await dht.store(key, subkey=subkey, value=value, expiration_time=expiration, return_future=True):
        return None
    found = await dht.get(key, latest=True, return_future=True)
    why = why_not_stored(found, subkey, value, expiration)
    return None if why is None else f"key {key!r} subkey ...{subkey[-6:]}: {why}"


def why_not_stored(found: object, subkey: str, value: object, expiration: float) -> str | None:
    """None when `found` (what a DHT read gives back for a key) holds `value` under `subkey` until `expiration` or
    later, else why it does not."""
    if found is None:
        return "no replica took it (the DHT gives back nothing under this key)"
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        return f"the key holds a {type(entries).__name__} value, not one entry per subkey, that outlives ours"
    entry = entries.get(subkey)
    if entry is None:
        return "no replica took it (the DHT gives back other subkeys' values, not ours)"
    if entry.expiration_time < expiration:
        return f"replicas keep an older value of ours (it expires {expiration - entry.expiration_time:.1f} s sooner)"
    if entry.expiration_time == expiration and entry.value != value:
        return "replicas keep a different value of ours with the same expiration"
    return None


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(addr) for addr in dht.get_visible_maddrs()]
