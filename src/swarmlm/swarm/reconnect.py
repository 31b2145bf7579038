"""Re-dialing lost peers, so that a restart does not split the swarm.

hivemind's routing table drops a peer as soon as one call to it fails, and nothing ever dials it again: a node that
restarts at the same address (same --identity and --port) finds nobody, and nobody finds it. So every node keeps a
book of the peers it may return to (its initial peers, and the DHT peers it has met) and, every few seconds, pings
those missing from its routing table. A ping adds each side to the other's table, and then each side hands the other
the records it should hold (hivemind does that for every peer it meets), so the swarm is whole again within one
re-dial interval of a peer's return.

A node that restarts knowing no one (the first server, started with --new-swarm) would have to wait for the others
to dial it, and p2pd delays dials to a peer whose earlier dials failed (its dial backoff grows to 5 minutes over a
long absence). So a node with a key file (--identity) keeps the peers it met in a file beside it and, once started
again, dials them itself at once: its connections are new to them, and nothing delays them.

The book is a pure value (PeerBook); the loop that consults it runs on the DHT's own event loop, in its process.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarmlm.net.dialing import dial

logger = logging.getLogger(__name__)

# seconds between two looks at the routing table: a returning peer is found again within about this long
RECONNECT_INTERVAL_S = 15.0
# longest one dial and ping of one peer may take: a dead host must not hold up the next round
DIAL_TIMEOUT_S = 5.0
# peers met (beyond the initial ones) remembered at most: a stranger cannot make a node hold or dial more
MAX_SEEN_PEERS = 64
# a met peer absent this long is forgotten (initial peers never are: an operator gave them)
FORGET_SEEN_S = 3600.0

# the file of met peers beside a key file: the key file's name with this added
PEERS_FILE_SUFFIX = ".peers.json"
# a peers file larger than this is not one this code wrote (64 peers with a few addresses each are a few KB)
MAX_PEERS_FILE_BYTES = 1 << 20

Addrs = tuple[str, ...]


def peers_of(maddrs: Sequence[str]) -> dict[str, Addrs]:
    """Full multiaddrs (.../p2p/<peer id>) grouped by peer id, each address without its trailing /p2p/ part."""
    peers: dict[str, list[str]] = {}
    for maddr in maddrs:
        peer = Multiaddr(maddr)["p2p"]
        address = maddr[: maddr.rindex("/p2p/")]
        peers.setdefault(peer, [])
        if address and address not in peers[peer]:
            peers[peer].append(address)
    return {peer: tuple(addrs) for peer, addrs in peers.items()}


@dataclass
class PeerBook:
    """The peers a node returns to when they are missing from its routing table: the initial ones, always; the ones
    it met, until absent for forget_after_s (and at most `capacity` of them, the longest absent forgotten first)."""

    initial: Mapping[str, Addrs]
    capacity: int = MAX_SEEN_PEERS
    forget_after_s: float = FORGET_SEEN_S
    # peer id -> (addresses, the last time it was in the routing table), least recently present first
    seen: OrderedDict[str, tuple[Addrs, float]] = field(default_factory=OrderedDict)

    def note(self, present: Mapping[str, Addrs], now: float) -> None:
        """Remember the peers in the routing table now, with the addresses they are connected at (empty: unknown,
        the ones remembered before are kept)."""
        for peer, addrs in present.items():
            if peer in self.initial:
                continue
            known = self.seen.pop(peer, ((), now))[0]
            self.seen[peer] = (addrs or known, now)
        for peer, (_, last) in list(self.seen.items()):
            if now - last > self.forget_after_s:
                del self.seen[peer]
        while len(self.seen) > self.capacity:
            self.seen.popitem(last=False)

    def addresses(self) -> dict[str, Addrs]:
        """The met peers and their addresses (what a peers file keeps), longest absent first."""
        return {peer: addrs for peer, (addrs, _) in self.seen.items()}

    def missing(self, present: Collection[str], own: str) -> dict[str, Addrs]:
        """The peers to dial now: those of the book not in the routing table (`present`), never this node (`own`)."""
        wanted = {**{peer: addrs for peer, (addrs, _) in self.seen.items()}, **self.initial}
        return {peer: addrs for peer, addrs in wanted.items() if peer not in present and peer != own}


def peers_file(identity_path: str | Path) -> Path:
    """Where a node with this key file keeps the peers it met."""
    path = Path(identity_path).expanduser()
    return path.with_name(path.name + PEERS_FILE_SUFFIX)


def load_peers(path: Path) -> dict[str, Addrs]:
    """The peers a peers file keeps; none when it is missing or unreadable (it is only a hint: logged, not fatal)."""
    try:
        if path.stat().st_size > MAX_PEERS_FILE_BYTES:
            raise ValueError(f"larger than {MAX_PEERS_FILE_BYTES} bytes")
        found = json.loads(path.read_text())
        if not isinstance(found, dict):
            raise ValueError("not a JSON object")
        return {
            str(peer): tuple(str(a) for a in addrs)
            for peer, addrs in found.items()
            if isinstance(addrs, list) and all(isinstance(a, str) for a in addrs)
        }
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("Ignoring the peers file %s: %s", path, e)
        return {}


def save_peers(path: Path, peers: Mapping[str, Addrs]) -> None:
    """Write the peers file whole or not at all (a crash mid-write leaves the previous one)."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps({peer: list(addrs) for peer, addrs in peers.items()}, indent=1))
    os.replace(partial, path)


def start_reconnecting(
    dht: hivemind.DHT, initial_peers: Sequence[str], interval_s: float, remember_in: Path | None = None
) -> None:
    """Re-dial, at once and then every interval_s for as long as the node lives, the initial peers and the met peers
    missing from its routing table (the loop runs in the DHT's process). With remember_in, the met peers are kept in
    that file, and those it kept from an earlier run are dialled too."""
    remembered = {} if remember_in is None else load_peers(remember_in)
    start = functools.partial(
        _start, book=PeerBook(peers_of(initial_peers)), remembered=remembered, interval_s=interval_s,
        remember_in=remember_in,
    )  # fmt: skip
    dht.run_coroutine(start)


# the loops started in this (DHT) process: asyncio keeps only weak references to tasks
_LOOPS: set[asyncio.Task[None]] = set()


async def _start(
    _dht: hivemind.DHT,
    node: DHTNode,
    *,
    book: PeerBook,
    remembered: Mapping[str, Addrs],
    interval_s: float,
    remember_in: Path | None,
) -> None:
    book.note(remembered, asyncio.get_running_loop().time())  # remembered peers count as met now, on this clock
    task = asyncio.create_task(_reconnect_forever(node, book, interval_s, remember_in))
    _LOOPS.add(task)
    task.add_done_callback(_LOOPS.discard)


async def _reconnect_forever(node: DHTNode, book: PeerBook, interval_s: float, remember_in: Path | None) -> None:
    failures, saved = 0, book.addresses()
    loop = asyncio.get_running_loop()
    while node.is_alive:
        try:
            await reconnect_once(node, book, loop.time())
            if remember_in is not None and book.addresses() != saved:
                saved = book.addresses()
                await asyncio.to_thread(save_peers, remember_in, saved)
        except Exception as e:  # noqa: BLE001 - best effort: one failed round must not end the re-dialing
            failures += 1
            logger.warning("Re-dialing lost peers failed (%d times so far): %s: %s", failures, type(e).__name__, e)
        await asyncio.sleep(interval_s)


async def reconnect_once(node: DHTNode, book: PeerBook, now: float) -> int:
    """Note the peers present, dial and ping the missing ones; how many answered."""
    table = node.protocol.routing_table.peer_id_to_uid
    present = {peer.to_base58() for peer in table}
    connected = {info.peer_id.to_base58(): info.addrs for info in await node.p2p.list_peers()}
    book.note({peer: tuple(str(a) for a in connected.get(peer, ())) for peer in present}, now)
    missing = book.missing(present, node.peer_id.to_base58())
    if not missing:
        return 0
    answers = await asyncio.gather(*(_redial(node, peer, addrs) for peer, addrs in missing.items()))
    for peer, answered in zip(missing, answers, strict=True):
        if answered:
            logger.info("Peer ...%s is back in the routing table", peer[-6:])
    return sum(answers)


async def _redial(node: DHTNode, peer_id: str, addrs: Addrs) -> bool:
    """Dial the peer at its addresses (p2pd may have forgotten them) and ping it: a ping that is answered puts each
    node in the other's routing table."""
    peer = PeerID.from_base58(peer_id)
    try:
        async with asyncio.timeout(DIAL_TIMEOUT_S):
            if addrs:
                await dial(node.p2p, peer, list(addrs), DIAL_TIMEOUT_S)
            return await node.protocol.call_ping(peer) is not None
    except Exception as e:  # noqa: BLE001 - a peer still away fails in assorted ways: all mean "not back yet"
        logger.debug("Peer ...%s did not answer a re-dial: %s: %s", peer_id[-6:], type(e).__name__, e)
        return False
