"""What a server did, counted for its operator: the periodic one-line summary at INFO (one per --summary-interval
while the server is busy, none while idle) and the drain's line.

Each request and inference step is logged at DEBUG only (a busy server makes hundreds a minute); these counts are
what INFO shows instead.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Activity:
    """Totals since the server started."""

    requests: int = 0  # forward and backward requests answered
    sessions: int = 0  # inference sessions opened
    steps: int = 0  # inference steps answered
    tokens: int = 0  # tokens of those requests and steps (batch x length)
    failed: int = 0  # requests and steps refused as bad or failed here

    def minus(self, before: Activity) -> Activity:
        return Activity(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})


def summary(done: Activity, seconds: float, open_sessions: int) -> str | None:
    """One line on `done`, the activity of the last `seconds`; None when there was none."""
    if done == Activity():
        return None
    return (f"Last {seconds:.0f} s: {done.sessions} sessions opened ({open_sessions} open now), {done.steps} "
            f"inference steps, {done.requests} forward/backward requests, {done.tokens} tokens, {done.failed} "
            "failed")  # fmt: skip


def drain_line(total: Activity, open_sessions: int) -> str:
    """The drain's line: what the server served in all, and what it waits for."""
    return (f"Shutting down: draining {open_sessions} open sessions (served {total.sessions} sessions with "
            f"{total.steps} steps and {total.requests} forward/backward requests, {total.tokens} tokens)")  # fmt: skip
