"""`swarmlm status`: the monitor's picture of the swarm once, as text or JSON, with an exit code a script can test.

It imports the monitor and the DHT only (no model code: hivemind alone costs ~2 s to import), so that a cron job or
a health check gets its answer in seconds.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from swarmlm.api.monitor import Monitor, format_status
from swarmlm.swarm.dht import is_loopback_maddr, start_dht

# exit codes of `swarmlm status` (2 is every command's code for bad input or an unreachable swarm, cli/main.py)
STATUS_COMPLETE = 0  # every model the swarm announces has a server for each of its blocks
STATUS_MISSING_BLOCKS = 1  # some model lacks a server for some block: its requests wait, then fail
STATUS_NO_MODEL = 3  # the swarm was reached, but no server announces any model


def client_dht(initial_peers: tuple[str, ...], swarm_key: bytes | None = None) -> Any:
    """A client-mode DHT node joined to the swarm (loopback-only when every peer is on this machine)."""
    host = "127.0.0.1" if initial_peers and all(is_loopback_maddr(p) for p in initial_peers) else "0.0.0.0"
    return start_dht(initial_peers, host=host, client_mode=True, swarm_key=swarm_key)


def status_code(snapshot: dict[str, Any]) -> int:
    """The exit code that sums a snapshot up (see STATUS_*)."""
    if not snapshot["models"]:
        return STATUS_NO_MODEL
    return STATUS_COMPLETE if all(model["complete"] for model in snapshot["models"]) else STATUS_MISSING_BLOCKS


def swarm_snapshot(dht: Any, swarm_key: bytes | None = None) -> dict[str, Any]:
    """The monitor's snapshot of the swarm, once, through the DHT node `dht`."""

    async def once() -> dict[str, Any]:
        monitor = Monitor(dht, swarm_key=swarm_key)
        try:
            return await monitor.snapshot()
        finally:
            await monitor.close()

    return asyncio.run(once())


def print_status(initial_peers: tuple[str, ...], swarm_key: bytes | None = None, as_json: bool = False) -> int:
    """Print the swarm's models, coverage and servers once; the exit code that sums them up."""
    dht = client_dht(initial_peers, swarm_key)
    try:
        snapshot = swarm_snapshot(dht, swarm_key)
    finally:
        dht.shutdown()
    print(json.dumps(snapshot, indent=2) if as_json else format_status(snapshot), end="\n" if as_json else "")
    return status_code(snapshot)
