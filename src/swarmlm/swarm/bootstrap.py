"""A bootstrap-only DHT node: it stores records and introduces peers, and serves no blocks."""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence

from swarmlm.swarm.dht import start_dht, visible_maddrs
from swarmlm.swarm.keyfile import load_or_create_identity
from swarmlm.swarm.reconnect import RECONNECT_INTERVAL_S, peers_file


def run_bootstrap(
    initial_peers: Sequence[str],
    host: str,
    port: int,
    swarm_key: bytes | None = None,
    *,
    relay: bool = True,
    identity_path: str | None = None,
    may_start_alone: bool = False,
    reconnect_interval_s: float = RECONNECT_INTERVAL_S,
) -> None:
    """Run until SIGINT/SIGTERM, printing the multiaddrs others join with (with swarm_key: of a private swarm,
    storing only its members' records). With relay, servers that accept no inbound connections are dialled through
    this node (`swarmlm serve --relay`): everyone reaches a bootstrap node, so it can relay for them.

    With identity_path (a key file, created if missing) and a fixed port, the node keeps its address across restarts:
    a stable entry point of the swarm (others dial it again when it comes back, see swarm/reconnect.py)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    key = load_or_create_identity(identity_path) if identity_path else None
    dht = start_dht(
        initial_peers, host=host, port=port, swarm_key=swarm_key, relay_service=relay, key=key,
        may_start_alone=may_start_alone, reconnect_interval_s=reconnect_interval_s,
        peers_file=peers_file(identity_path) if identity_path else None,
    )  # fmt: skip
    try:
        print("Others join with: --initial-peers " + " ".join(visible_maddrs(dht)), flush=True)
        print("DHT ready", flush=True)
        stop.wait()
    finally:
        dht.shutdown()
