"""The swarm as the monitor shows it: every model in the catalog, its coverage block by block, and its servers.

Records say what servers claim; a server that crashed keeps its record until it expires. The monitor therefore also
asks every announced server for its info (rpc_info) at each refresh: one that does not answer is shown unreachable
and leaves a gap in its model's coverage at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import hivemind
from hivemind.p2p import P2P, PeerID

from swarmlm.models.naming import name_from_identity
from swarmlm.net.dialing import dial
from swarmlm.net.info import request_info
from swarmlm.protocol.messages import ServerInfo
from swarmlm.swarm import private
from swarmlm.swarm.catalog import catalog_key, fetch_catalog
from swarmlm.swarm.records import ServerRecord, ServerState, fetch_servers

logger = logging.getLogger(__name__)

# the page asks for a new snapshot this often; snapshots younger than half of it are shared between viewers
REFRESH_S = 2.0
# a server that does not answer rpc_info within this time is shown unreachable
PROBE_TIMEOUT_S = 2.0
# bound on each DHT read of a snapshot
DHT_TIMEOUT_S = 5.0


def short_id(peer_id: str) -> str:
    return f"...{peer_id[-6:]}"


class Monitor:
    """Snapshots of the swarm read through `dht`; `client` adds what a local client knows (its route, latencies).
    With `swarm_key`, the private swarm of that key (the DHT node must hold the key too)."""

    def __init__(
        self,
        dht: hivemind.DHT,
        client: Callable[[], dict[str, Any] | None] = lambda: None,
        swarm_key: bytes | None = None,
    ):
        self.dht, self.client, self.swarm_key = dht, client, swarm_key
        self._joined: set[str] = set()  # servers of a private swarm this monitor proved its membership to
        self._p2p: P2P | None = None
        self._seen: dict[str, float] = {}  # peer -> unix time it last answered rpc_info
        self._infos: dict[str, ServerInfo] = {}  # peer -> its last answer
        self._last: tuple[float, dict[str, Any]] | None = None
        self._lock = asyncio.Lock()

    async def snapshot(self) -> dict[str, Any]:
        """The swarm now (shared with other viewers when younger than half the refresh period)."""
        async with self._lock:
            if self._last is None or time.monotonic() - self._last[0] > REFRESH_S / 2:
                self._last = (time.monotonic(), await self._read())
            return self._last[1]

    async def _read(self) -> dict[str, Any]:
        async with asyncio.timeout(DHT_TIMEOUT_S):
            catalog = await fetch_catalog(self.dht, catalog_key(self.swarm_key))
        models: dict[str, tuple[str, Counter[int]]] = {}  # dht prefix -> (model name, its entries' block counts)
        for entry in catalog.values():
            # servers name their model by its display name; older ones sent what they were given, maybe a path
            shown = name_from_identity(entry.model).display
            name, counts = models.setdefault(entry.dht_prefix, (shown, Counter()))
            counts[entry.num_blocks] += 1
        described = []
        for prefix, (name, counts) in sorted(models.items()):
            # entries are claims: the count most of them give (the smaller on a tie), not the largest any gives
            num_blocks = min(counts, key=lambda blocks: (-counts[blocks], blocks))
            async with asyncio.timeout(DHT_TIMEOUT_S):
                records = await fetch_servers(self.dht, prefix, num_blocks)
            reachable = await self._probe(records)
            described.append(describe_model(name, prefix, num_blocks, records, reachable, self._seen))
        return {"generated_at": time.time(), "refresh_s": REFRESH_S, "models": described, "client": self.client()}

    async def _probe(self, records: dict[str, ServerRecord]) -> dict[str, bool]:
        """Which of the servers (all but those announced offline) answer rpc_info now."""
        peers = [peer for peer, record in records.items() if record.state != ServerState.OFFLINE]
        answers = await asyncio.gather(*(self._ask(peer, records[peer]) for peer in peers))
        return dict(zip(peers, answers, strict=True))

    async def _ask(self, peer_id: str, record: ServerRecord) -> bool:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                if self._p2p is None:
                    self._p2p = await self.dht.replicate_p2p()
                peer = PeerID.from_base58(peer_id)
                if record.addrs:
                    await dial(self._p2p, peer, list(record.addrs), PROBE_TIMEOUT_S)
                if self.swarm_key is not None and peer_id not in self._joined:
                    # a private swarm's server answers only peers that proved they hold its key
                    if not await private.join(self._p2p, peer, self.swarm_key, PROBE_TIMEOUT_S):
                        return False
                    self._joined.add(peer_id)
                info = await request_info(self._p2p, peer, PROBE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - whatever fails, the server did not answer: that is what is shown
            logger.debug("Server %s did not answer rpc_info: %r", short_id(peer_id), e)
            return False
        if info is None:
            return False
        self._infos[peer_id], self._seen[peer_id] = info, time.time()
        return True

    async def close(self) -> None:
        if self._p2p is not None:
            with contextlib.suppress(Exception):
                await self._p2p.shutdown()


def describe_model(
    name: str,
    prefix: str,
    num_blocks: int,
    records: dict[str, ServerRecord],
    reachable: dict[str, bool],
    seen: dict[str, float],
) -> dict[str, Any]:
    """One model of the snapshot: coverage per block by the online servers that answer, and the server table (records
    beyond the model's blocks are left out)."""
    records = {peer: record for peer, record in records.items() if record.end <= num_blocks}
    servers_per_block, throughput = [0] * num_blocks, [0.0] * num_blocks
    rows = []
    now = time.time()
    for peer, record in sorted(records.items(), key=lambda item: (item[1].start, item[1].end, item[0])):
        state = record.state.value
        if record.state != ServerState.OFFLINE and not reachable.get(peer, False):
            state = "unreachable"
        if state == ServerState.ONLINE.value:
            for block in range(record.start, min(record.end, num_blocks)):
                servers_per_block[block] += 1
                throughput[block] += record.throughput
        rows.append({
            "peer_id": peer,
            "short_id": short_id(peer),
            "start": record.start,
            "end": record.end,
            "state": state,
            "version": record.version,
            "dtype": record.dtype,
            "throughput": round(record.throughput, 1),
            "throughput_source": record.throughput_source,
            "inference_throughput": None if record.inference_throughput is None else round(
                record.inference_throughput, 1),
            "sessions_open": record.sessions_open,
            "cache_tokens_left": record.cache_tokens_left,
            "cache_tokens_total": record.cache_tokens_total,
            "last_seen_s": round(now - seen[peer], 1) if peer in seen else None,
        })  # fmt: skip
    missing = [block for block, count in enumerate(servers_per_block) if count == 0]
    return {
        "name": name,
        "dht_prefix": prefix,
        "num_blocks": num_blocks,
        "complete": not missing,
        "missing_blocks": missing,
        "blocks": [
            {"servers": count, "throughput": round(total, 1)}
            for count, total in zip(servers_per_block, throughput, strict=True)
        ],
        "servers": rows,
    }


def format_status(snapshot: dict[str, Any]) -> str:
    """The snapshot as terminal text: per model a coverage line and a table of servers."""
    lines: list[str] = []
    if not snapshot["models"]:
        lines.append("No model is served in this swarm (no server announces one).")
    for model in snapshot["models"]:
        missing = model["missing_blocks"]
        verdict = "complete" if not missing else f"MISSING blocks {ranges(missing)}"
        lines.append(f"Model {model['name']} (swarm {model['dht_prefix']!r}): {model['num_blocks']} blocks, {verdict}")
        bar = "".join("#" if block["servers"] > 1 else "=" if block["servers"] else "." for block in model["blocks"])
        lines.append(f"  coverage [{bar}]  (# 2+ servers, = one, . none)")
        lines.append(_table(model["servers"]))
        lines.extend(_speed_sources(model["servers"]))
        lines.append("")
    client = snapshot.get("client")
    if client:
        route = " -> ".join(f"{hop['short_id']}[{hop['start']}:{hop['end']}]" for hop in client["route"]) or "-"
        lines.append(f"This client's route: {route}")
    return "\n".join(lines).rstrip() + "\n"


HEADERS = ("peer", "blocks", "state", "version", "tokens/s", "sessions", "cache free", "last seen")


def _table(servers: list[dict[str, Any]]) -> str:
    rows = [HEADERS] + [
        (
            server["short_id"],
            f"{server['start']}:{server['end']}",
            server["state"],
            server["version"] or "?",
            f"{server['throughput']:.0f}",
            str(server["sessions_open"]),
            _cache(server),
            "-" if server["last_seen_s"] is None else f"{server['last_seen_s']:.0f} s ago",
        )
        for server in servers
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS))]
    return "\n".join(
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _speed_sources(servers: list[dict[str, Any]]) -> list[str]:
    """How the servers' tokens/s were found (measured at start, or kept from an earlier measurement there): one line
    per distinct description, with the servers it applies to."""
    if not servers:
        return []
    by_source: dict[str, list[str]] = {}
    for server in servers:
        source = server.get("throughput_source") or "not said (an older server)"
        by_source.setdefault(source, []).append(server["short_id"])
    return ["  tokens/s: " + "; ".join(f"{source} ({', '.join(ids)})" for source, ids in by_source.items())]


def _cache(server: dict[str, Any]) -> str:
    left, total = server["cache_tokens_left"], server["cache_tokens_total"]
    return "?" if left is None else f"{left}/{total}"


def ranges(blocks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[str] = []
    for block in blocks:
        if parts and block == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{block}"
        else:
            parts.append(str(block))
    return ", ".join(parts)
