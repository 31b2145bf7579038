"""An inference session's recovery as plans: data that pure functions compute from the session's state, and that
client/session_recovery.py carries out over the links (nothing here touches a socket or the clock).

A plan says which spans of the route are kept as they are, which are routed again (over which blocks, from which
block on) with which committed history replayed into the new servers' caches, and after a failed push, which links
are closed and which server is blamed or only asked whether it is still there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swarmlm.client.session_state import H, Hop, SessionState, merge_history
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.swarm.routing import RouteSpan


@dataclass(frozen=True)
class Rebuild:
    """Route a lost span's blocks again (over one new server or several) and replay its committed steps there."""

    lost: RouteSpan  # the server and blocks replaced
    history: tuple[SpanTensors, ...]  # the steps its cache had committed, as that span got them

    @property
    def start(self) -> int:
        return self.lost.start

    @property
    def end(self) -> int:
        return self.lost.end

    def requests(self, max_tokens: int) -> list[SpanTensors]:
        """The replay in as few requests as max_tokens tokens each allows: a few round trips, not one per token."""
        return merge_history(list(self.history), max_tokens)


def plan_rebuild(hop: Hop) -> Rebuild:
    """The plan that puts a hop's cache back on a new route: its blocks, and everything its cache had committed."""
    return Rebuild(hop.span, tuple(hop.state.history))


def plan_repair(state: SessionState[H]) -> list[Rebuild | None]:
    """What brings every span back to the session's position after a failed step, one entry per hop in route order:
    None keeps a hop (its next step cuts back what it ran); a Rebuild replaces one whose server cannot undo what it
    ran (it reordered its cache rows) or whose cache is lost."""
    return [plan_rebuild(hop) if hop.state.must_rebuild(hop.lost) else None for hop in state.route]


@dataclass(frozen=True)
class Reopen:
    """After opening a route's spans at once, some failed: keep the hops before the first failure, close the others
    and route again from that span's first block."""

    keep: int  # hops of the route that opened and stay
    from_block: int  # where the route is looked for again


def plan_reopen(route: Sequence[RouteSpan], failed: Sequence[bool]) -> Reopen | None:
    """None when every span of `route` opened; else where to go on from (the spans after a failed one are routed
    again with it, since a new route for its blocks may cut the next spans differently)."""
    first = next((index for index, bad in enumerate(failed) if bad), None)
    return None if first is None else Reopen(keep=first, from_block=route[first].start)


def blame_in_replay(plan: Rebuild, replacement: Sequence[RouteSpan], error_peer: str | None) -> RouteSpan:
    """Whose failure a failed replay counts as: the new server that the error names, else the lost span (an error
    that names none of the new servers is charged to the blocks being rebuilt)."""
    return next((span for span in replacement if span.peer_id == error_peer), plan.lost)


@dataclass(frozen=True)
class PushFailure:
    """What follows a pushed step that failed: the links from hop `drop_from` on are closed (the step may still be
    travelling towards them; the next step's repair rebuilds them); then the server of hop `blame` counts as failed
    with the call's error, or the server of hop `ask` is asked whether it is still there (one server's word that it
    could not push there never makes a client avoid another)."""

    drop_from: int
    blame: int | None = None
    ask: int | None = None


def plan_push_failure(state: SessionState[H], index: int, call_failed: bool, error_peer: str | None) -> PushFailure:
    """The plan after a pushed step failed at hop `index`: its call failed (call_failed; error_peer: the server the
    error names), or it answered but could not push on."""
    route = state.route
    peers = [hop.span.peer_id for hop in route]
    # a hop that ran the step and holds it pending is cut back by its next step; one that did not may still get it
    drop_from = index if route[index].state.pending is None else index + 1
    if not call_failed:
        return PushFailure(drop_from, ask=index + 1 if index + 1 < len(route) else None)
    later = [i for i in range(index + 1, len(route)) if peers[i] == error_peer]
    if later:
        # a server the step was pushed on to went silent while this one waited for it: everything from here is
        # rebuilt (the step may still be on its way), and the failure is that server's, not this one's
        return PushFailure(index, blame=later[0])
    if index > 0 and error_peer == peers[index - 1]:
        # the server that should have pushed here went silent: its cache is lost to us as well
        return PushFailure(index - 1, blame=index - 1)
    return PushFailure(drop_from, blame=index)
