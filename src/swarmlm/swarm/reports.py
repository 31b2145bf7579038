"""Reports of servers caught returning wrong results, published on the DHT for other clients to weigh.

Each client keeps one entry under the model's reports key, with its own peer id as subkey: a dictionary from the
peer ids it caught to what it saw. Entries are signed like server records (swarm/identity.py): only the reporter
can write its entry, so a report names its author and cannot be forged for another client. A report is a claim of
one client, not a proof: readers count distinct reporters and spend more spot checks on the accused (they do not
ban them on hearsay, or any client could have honest servers banned).
"""

from __future__ import annotations

import logging

import hivemind
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarmlm.swarm.identity import public_key_of

logger = logging.getLogger(__name__)

# accusations read from one reporter's entry (a hostile one may write many)
MAX_ACCUSED_PER_REPORTER = 64
# longest reason text kept
MAX_REASON_CHARS = 300


class Report(BaseModel):
    """What a client saw of one server."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    reason: str = Field(max_length=MAX_REASON_CHARS)
    start: int = Field(ge=0)  # the blocks whose result was wrong
    end: int = Field(ge=1)
    time: float = Field(ge=0)  # DHT time of the detection


def reports_key(dht_prefix: str) -> str:
    return f"{dht_prefix}.reports"


async def publish(dht: hivemind.DHT, dht_prefix: str, reporter: str, reports: dict[str, Report], ttl_s: float) -> bool:
    """Store this client's whole entry (all servers it caught), replacing its previous one."""
    value = {peer: report.model_dump(mode="json") for peer, report in reports.items()}
    return await dht.store(
        reports_key(dht_prefix), subkey=reporter, value=value, expiration_time=get_dht_time() + ttl_s,
        return_future=True,
    )  # fmt: skip


async def fetch_reported(dht: hivemind.DHT, dht_prefix: str) -> dict[str, int]:
    """How many distinct clients reported each accused server (unexpired, signed, readable entries only)."""
    found = await dht.get(reports_key(dht_prefix), latest=True, return_future=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    counts: dict[str, int] = {}
    for reporter, entry in found.value.items():
        if not isinstance(reporter, str) or public_key_of(reporter) is None or not isinstance(entry.value, dict):
            continue
        for accused, raw in list(entry.value.items())[:MAX_ACCUSED_PER_REPORTER]:
            if not isinstance(accused, str) or accused == reporter or public_key_of(accused) is None:
                continue
            try:
                Report.model_validate(raw)
            except (ValidationError, TypeError, ValueError) as e:
                logger.debug("Ignoring an unreadable report by %s: %s", reporter, e)
                continue
            counts[accused] = counts.get(accused, 0) + 1
    return counts
