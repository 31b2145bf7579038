"""A server's record store against a rogue DHT replica (real DHT nodes on 127.0.0.1): a replica that refuses every
store fails hivemind's answer, yet the record is stored on the others; only a record the DHT does not give back is
a failure, and the failure says which key and subkey, and why."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import hivemind
from hivemind.utils import get_dht_time

from swarmlm.swarm.dht import start_dht, store_subkey, visible_maddrs
from swarmlm.swarm.records import ServerRecord, ServerState, announce, fetch_servers, servers_key

PREFIX = "rogue-replica"
RECORD = ServerRecord(state=ServerState.ONLINE, start=0, end=5, throughput=1.0, dtype="float32")


async def _refuse_every_store(dht: hivemind.DHT, node: hivemind.DHTNode) -> None:
    """Run in a rogue's DHT process: its storage answers every store with False, holding nothing."""
    node.protocol.storage.store = lambda *args, **kwargs: False
    node.protocol.storage.store_subkey = lambda *args, **kwargs: False


def rogue_node(initial_peers: list[str] | None = None) -> hivemind.DHT:
    rogue = start_dht(initial_peers or [], host="127.0.0.1")
    rogue.run_coroutine(_refuse_every_store)
    return rogue


@contextmanager
def started(*dhts: hivemind.DHT) -> Iterator[None]:
    try:
        yield
    finally:
        for dht in dhts:
            dht.shutdown()


def test_a_rogue_replica_fails_hiveminds_answer_but_not_the_announcement() -> None:
    rogue = rogue_node()
    server = start_dht(visible_maddrs(rogue), host="127.0.0.1")
    with started(server, rogue):
        me = server.peer_id.to_base58()
        # the server's own replica takes the record, the rogue's answer comes last: hivemind calls the store failed
        value, expiration = RECORD.model_dump(mode="json"), get_dht_time() + 10
        assert server.store(servers_key(PREFIX), subkey=me, value=value, expiration_time=expiration) is False
        assert asyncio.run(announce(server, PREFIX, me, RECORD, ttl_s=30)) is None  # yet it is there: no failure
        assert asyncio.run(fetch_servers(server, PREFIX))[me] == RECORD


def test_a_value_no_replica_holds_is_a_failure_that_says_where_and_why() -> None:
    rogue = rogue_node()  # alone: it is the only replica, and it takes nothing
    with started(rogue):
        why = asyncio.run(store_subkey(rogue, "rogue-only.servers", "12D3KooWsubkey", {"x": 1}, ttl_s=30))
    assert why is not None and "'rogue-only.servers'" in why and "...subkey" in why, why
    assert "no replica took it" in why, why
