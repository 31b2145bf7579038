"""`swarmlm status`'s text: how each server's announced speed was found is said beside the table."""

from __future__ import annotations

from swarmlm.api.monitor import describe_model, format_status
from swarmlm.swarm.records import ServerRecord, ServerState


def record(start: int, end: int, source: str) -> ServerRecord:
    return ServerRecord(
        state=ServerState.ONLINE, start=start, end=end, throughput=100.0, throughput_source=source, dtype="float32"
    )


def test_status_says_how_each_servers_speed_was_measured() -> None:
    records = {
        "peerA": record(0, 2, "measured now, kept in the cache"),
        "peerB": record(2, 4, "measured on this machine at 2026-12-06 10:00, kept in the cache"),
        "peerC": record(2, 4, "measured now, kept in the cache"),
        "peerD": record(0, 4, ""),  # a server too old to say
    }
    model = describe_model("m", "m-prefix", 4, records, dict.fromkeys(records, True), {})
    assert {row["short_id"][-5:]: row["throughput_source"] for row in model["servers"]}["peerB"].startswith(
        "measured on this machine at 2026-12-06 10:00"
    )
    text = format_status({"models": [model], "client": None})
    speeds = next(line for line in text.splitlines() if line.strip().startswith("tokens/s:"))
    short = {row["short_id"][-5:]: row["short_id"] for row in model["servers"]}
    assert f"measured now, kept in the cache ({short['peerA']}, {short['peerC']})" in speeds
    assert f"measured on this machine at 2026-12-06 10:00, kept in the cache ({short['peerB']})" in speeds
    assert f"not said (an older server) ({short['peerD']})" in speeds
