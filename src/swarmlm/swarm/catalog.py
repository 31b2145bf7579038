"""The swarm's catalog: which models are served at all, so a monitor can find every model's records.

Each server writes one entry under a well-known key with its own peer id as subkey (signed like its server record,
see swarm/identity.py): the DHT prefix its model's records live under, the model's name and its number of blocks.
A private swarm's servers write theirs under the key blinded with the swarm key (sealed like all its records), so
that its members' monitors find its models and outsiders do not.
"""

from __future__ import annotations

import logging

import hivemind
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarmlm.swarm.dht import store_subkey
from swarmlm.swarm.identity import public_key_of
from swarmlm.swarm.private import blind_prefix

logger = logging.getLogger(__name__)

CATALOG_KEY = "swarmlm.catalog"
# names longer than this are no model name anyone typed: the entry is ignored
MAX_NAME_CHARS = 256
# no decoder has this many blocks: an entry claiming more is ignored (a monitor draws a bar of that many cells)
MAX_BLOCKS = 10_000


def catalog_key(swarm_key: bytes | None = None) -> str:
    """Where the catalog lives: the well-known key, or a private swarm's blinded one."""
    return CATALOG_KEY if swarm_key is None else blind_prefix(CATALOG_KEY, swarm_key)


class CatalogEntry(BaseModel):
    """One server's line in the catalog."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    dht_prefix: str = Field(min_length=1, max_length=MAX_NAME_CHARS)  # where the model's server records live
    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)  # the model as its server was told to serve it
    num_blocks: int = Field(ge=1, le=MAX_BLOCKS)  # blocks of the whole model
    announced_at: float = Field(ge=0)  # DHT time of this announcement


async def announce_entry(
    dht: hivemind.DHT, peer_id: str, entry: CatalogEntry, ttl_s: float, key: str = CATALOG_KEY
) -> str | None:
    """Store (or refresh) this server's catalog entry under `key` (catalog_key()), which expires after ttl_s unless
    refreshed; None once the DHT holds it, else what failed and why (swarm/dht.py, store_subkey)."""
    return await store_subkey(dht, key, peer_id, entry.model_dump(mode="json"), ttl_s)


async def fetch_catalog(dht: hivemind.DHT, key: str = CATALOG_KEY) -> dict[str, CatalogEntry]:
    """Every unexpired, readable catalog entry under `key` (catalog_key()), by the peer id of the server that wrote
    it."""
    found = await dht.get(key, latest=True, return_future=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    entries = {}
    for peer_id, item in found.value.items():
        if not isinstance(peer_id, str) or public_key_of(peer_id) is None:
            continue
        try:
            entries[peer_id] = CatalogEntry.model_validate(item.value)
        except (ValidationError, AttributeError, TypeError, ValueError) as e:
            logger.debug("Ignoring unreadable catalog entry of %s: %s", peer_id, e)
    return entries
