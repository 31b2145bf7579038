"""A bootstrap-only DHT node: it stores records and introduces peers, and serves no blocks."""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence

from swarmlm.swarm.dht import start_dht, visible_maddrs


def run_bootstrap(
    initial_peers: Sequence[str], host: str, port: int, swarm_key: bytes | None = None, *, relay: bool = True
) -> None:
    """Run until SIGINT/SIGTERM, printing the multiaddrs others join with (with swarm_key: of a private swarm,
    storing only its members' records). With relay, servers that accept no inbound connections are dialled through
    this node (`swarmlm serve --relay`): everyone reaches a bootstrap node, so it can relay for them."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    dht = start_dht(initial_peers, host=host, port=port, swarm_key=swarm_key, relay_service=relay)
    try:
        print("Others join with: --initial-peers " + " ".join(visible_maddrs(dht)), flush=True)
        print("DHT ready", flush=True)
        stop.wait()
    finally:
        dht.shutdown()
