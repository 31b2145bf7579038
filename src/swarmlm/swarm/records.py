"""What a server announces on the DHT, and reading the swarm's announcements back."""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Annotated

import hivemind
from hivemind.utils.multiaddr import Multiaddr
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator

from swarmlm.protocol.messages import ADAPTER_NAME_PATTERN, PROTOCOL_VERSION
from swarmlm.swarm.dht import store_subkey
from swarmlm.swarm.identity import public_key_of

logger = logging.getLogger(__name__)

# a record naming more LoRA adapters than this is refused (a server loads each into memory: real ones hold a few)
MAX_ADAPTERS = 256
# no model has anywhere near this many blocks (the largest open ones have ~130): a span ending beyond it is a lie
MAX_BLOCKS = 1 << 16
# a record's description of how its throughput was found is cut at this length (records are strangers' claims)
MAX_SOURCE_CHARS = 120
AdapterName = Annotated[str, StringConstraints(pattern=ADAPTER_NAME_PATTERN)]


class ServerState(StrEnum):
    JOINING = "joining"
    ONLINE = "online"
    OFFLINE = "offline"
    DRAINING = "draining"  # leaving (or moving): finishes its open sessions, takes no new work


class ServerRecord(BaseModel):
    """One server's announcement, stored under the model's key with the server's peer id as subkey."""

    # newer servers may announce more fields; a client reads what it knows. Records come from the network:
    # numbers must be finite, so that no NaN or infinity reaches routing.
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    state: ServerState
    start: int = Field(ge=0)  # first block served
    end: int = Field(ge=1, le=MAX_BLOCKS)  # one past the last block served
    throughput: float = Field(gt=0)  # tokens/s through one block, as the server measured itself (a claim)
    # how the server found that figure, for operators (measured now, or kept from an earlier measurement here)
    throughput_source: str = ""
    dtype: str  # compute dtype of the server's blocks
    protocol_version: int = PROTOCOL_VERSION
    addrs: tuple[str, ...] = ()  # multiaddrs the server listens on
    fingerprint: str = ""  # models/fingerprint.py of the model served ("" from servers too old to say)
    version: str = ""  # swarmlm package version of the server
    max_tokens_per_request: int = Field(default=0, ge=0)  # batch * sequence tokens one request may carry (0: unknown)
    cache_tokens_total: int = Field(default=0, ge=0)  # KV-cache budget of the server, in block-tokens
    cache_tokens_left: int | None = Field(default=None, ge=0)  # KV-cache block-tokens free now (None: unknown)
    inference_throughput: float | None = Field(default=None, gt=0)  # decode steps/s through one block, if measured
    sessions_open: int = Field(default=0, ge=0)  # inference sessions open now (0 also from servers too old to say)
    queue_depth: float = Field(default=0.0, ge=0)  # compute turns a new request waits for, averaged (0: idle/unknown)
    since: float = Field(default=0.0, ge=0)  # DHT time the server claimed this span (placement's tie-break)
    adapters: tuple[AdapterName, ...] = Field(default=(), max_length=MAX_ADAPTERS)  # LoRA adapters requests may name

    @field_validator("throughput_source")
    @classmethod
    def _cut_source(cls, source: str) -> str:
        # a longer description is cut, not refused: the record's figures stay usable
        return source[:MAX_SOURCE_CHARS]

    @field_validator("addrs")
    @classmethod
    def _parseable_addrs(cls, addrs: tuple[str, ...]) -> tuple[str, ...]:
        # an address the client cannot parse would fail its dial; reject the record instead
        for addr in addrs:
            Multiaddr(addr.split("/p2p/")[0])  # raises StringParseError, a ValueError: pydantic reports it
        return addrs

    @model_validator(mode="after")
    def _a_span(self) -> ServerRecord:
        # an empty or reversed span serves nothing: routing must never see one
        if self.start >= self.end:
            raise ValueError(f"start {self.start} must be below end {self.end}")
        return self


def servers_key(dht_prefix: str) -> str:
    return f"{dht_prefix}.servers"


async def announce(dht: hivemind.DHT, dht_prefix: str, peer_id: str, record: ServerRecord, ttl_s: float) -> str | None:
    """Store (or refresh) this server's record, which expires after ttl_s unless refreshed; None once the DHT holds
    it, else what failed and why (swarm/dht.py, store_subkey)."""
    return await store_subkey(dht, servers_key(dht_prefix), peer_id, record.model_dump(mode="json"), ttl_s)


async def fetch_servers(dht: hivemind.DHT, dht_prefix: str, num_blocks: int | None = None) -> dict[str, ServerRecord]:
    """All unexpired, readable server records of this model, keyed by peer id (base58); given the model's number of
    blocks, without records claiming blocks it does not have (a lie that would make the swarm look incomplete)."""
    found = await dht.get(servers_key(dht_prefix), latest=True, return_future=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    records = {}
    for peer_id, entry in found.value.items():
        # DHT validators already drop records not signed by their subkey's peer id; this also guards against a
        # node without them (garbage subkeys, values of the wrong type)
        if not isinstance(peer_id, str) or public_key_of(peer_id) is None:
            logger.debug("Ignoring a record under %r: not an Ed25519 peer id", str(peer_id)[:60])
            continue
        try:
            record = ServerRecord.model_validate(entry.value)
        except (ValidationError, AttributeError, TypeError, ValueError) as e:
            logger.debug("Ignoring unreadable record of %s: %s", peer_id, e)
            continue
        if num_blocks is not None and record.end > num_blocks:
            logger.debug("Ignoring the record of %s: blocks %d:%d of a %d-block model", peer_id, record.start,
                         record.end, num_blocks)  # fmt: skip
            continue
        records[peer_id] = record
    return records
