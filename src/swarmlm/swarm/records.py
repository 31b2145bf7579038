"""What a server announces on the DHT, and reading the swarm's announcements back."""

from __future__ import annotations

import logging
from enum import StrEnum

import hivemind
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarmlm.protocol.messages import PROTOCOL_VERSION

logger = logging.getLogger(__name__)


class ServerState(StrEnum):
    JOINING = "joining"
    ONLINE = "online"
    OFFLINE = "offline"


class ServerRecord(BaseModel):
    """One server's announcement, stored under the model's key with the server's peer id as subkey."""

    # newer servers may announce more fields; a client reads what it knows
    model_config = ConfigDict(extra="ignore", frozen=True)

    state: ServerState
    start: int = Field(ge=0)  # first block served
    end: int = Field(ge=1)  # one past the last block served
    throughput: float = Field(gt=0)  # measured tokens/s through one block
    dtype: str  # compute dtype of the server's blocks
    protocol_version: int = PROTOCOL_VERSION
    addrs: tuple[str, ...] = ()  # multiaddrs the server listens on


def servers_key(dht_prefix: str) -> str:
    return f"{dht_prefix}.servers"


async def announce(dht: hivemind.DHT, dht_prefix: str, peer_id: str, record: ServerRecord, ttl_s: float) -> bool:
    """Store (or refresh) this server's record; it expires after ttl_s unless refreshed."""
    return await dht.store(
        servers_key(dht_prefix),
        subkey=peer_id,
        value=record.model_dump(mode="json"),
        expiration_time=get_dht_time() + ttl_s,
        return_future=True,
    )


async def fetch_servers(dht: hivemind.DHT, dht_prefix: str) -> dict[str, ServerRecord]:
    """All unexpired, readable server records of this model, keyed by peer id (base58)."""
    found = await dht.get(servers_key(dht_prefix), latest=True, return_future=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    records = {}
    for peer_id, entry in found.value.items():
        try:
            records[str(peer_id)] = ServerRecord.model_validate(entry.value)
        except (ValidationError, AttributeError) as e:
            logger.debug("Ignoring unreadable record of %s: %s", peer_id, e)
    return records
