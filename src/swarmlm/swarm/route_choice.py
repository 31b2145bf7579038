"""The one route choice: every rule a client applies when it picks servers (bans and busy cool-downs, announced cache
room, load, stickiness, near-tie draws, exploration of servers never measured), as a pure function of what the client
knows. The client's SequenceManager and the simulator both call choose_route, so the simulator measures this code."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from swarmlm.swarm.routing import FULL_REQUEST_TOKENS, Policy, RouteSpan, ServerView, find_route


@dataclass(frozen=True)
class RouteRequest:
    """What the route is for: blocks [start, end) for `tokens` tokens per request; session_tokens (batch x
    max_length) when it opens inference sessions of that size; without spread, the cheapest route (no draw, no
    stickiness, no exploration: spot checks want few servers)."""

    start: int
    end: int
    tokens: int = 1
    policy: Policy = "latency"
    session_tokens: int | None = None
    spread: bool = True


@dataclass(frozen=True)
class Knowledge:
    """What the client knows beyond the views: whom it avoids, whom it used lately, whom it never measured, and its
    routing options."""

    banned: frozenset[str] = frozenset()  # failed, distrusted, unreachable, or avoided by this request
    busy: frozenset[str] = frozenset()  # cooling down after a busy answer (no failure of theirs)
    prefer: frozenset[str] = frozenset()  # used recently: kept unless another is cheaper by the stickiness margin
    unmeasured: frozenset[str] = frozenset()  # never timed a call of, and not known to be silent: worth a try
    explore: bool = False  # it is time to try one of the unmeasured servers (once per explore_interval_s)
    tie_tolerance: float = 0.0
    stickiness: float = 0.0
    full_tokens: int = FULL_REQUEST_TOKENS  # the client's max_tokens_per_request (the throughput policy's request)


@dataclass(frozen=True)
class RouteChoice:
    """A route, and the never-measured server it goes through to try it (None: no exploration)."""

    route: list[RouteSpan]
    explored: str | None = None


def lacks_room(view: ServerView, session_tokens: int, start: int, end: int) -> bool:
    """Whether a server's announced free cache (block-tokens) cannot hold a new session of `session_tokens` tokens at
    each block of [start, end) it holds: opening one there would only be refused. A route may use fewer of those
    blocks, so this errs towards full; a server announcing no figure has room as far as the client knows."""
    blocks = max(0, min(end, view.end) - max(start, view.start))
    return view.cache_tokens_left is not None and view.cache_tokens_left < session_tokens * blocks


def choose_route(
    views: Sequence[ServerView], request: RouteRequest, known: Knowledge, rng: random.Random | None
) -> RouteChoice | None:
    """The route a client takes now, or None when no server it may use covers some block.

    Servers cooling down after a busy answer are avoided like banned ones. For a session, servers announcing too
    little free cache for it are avoided while others can serve their blocks (announcements lag: when none can, the
    servers themselves answer). When it is time to explore, the route is the cheapest one through a randomly drawn
    never-measured server (its announced speed is only a claim: without a try a better replica could stay unknown)."""
    start, end = request.start, request.end
    banned = known.banned | known.busy
    roomy = banned
    if request.session_tokens is not None:
        roomy = banned | {v.peer_id for v in views if lacks_room(v, request.session_tokens, start, end)}
    if request.spread and known.explore:
        explored = _explore(views, request, known, roomy, rng)
        if explored is not None:
            return explored
    for avoid in (roomy, banned) if roomy != banned else (banned,):
        route = _find(views, request, known, avoid, rng)
        if route is not None:
            return RouteChoice(route)
    return None


def _find(
    views: Sequence[ServerView], request: RouteRequest, known: Knowledge, avoid: frozenset[str],
    rng: random.Random | None,
) -> list[RouteSpan] | None:  # fmt: skip
    """find_route drawing among near-equal routes and preferring recently used servers (without spread: cheapest)."""
    if not request.spread:
        return find_route(views, request.start, request.end, banned=avoid, tokens=request.tokens,
                          policy=request.policy, full_tokens=known.full_tokens)  # fmt: skip
    return find_route(
        views, request.start, request.end, banned=avoid, tokens=request.tokens, rng=rng,
        tie_tolerance=known.tie_tolerance, prefer=known.prefer, stickiness=known.stickiness, policy=request.policy,
        full_tokens=known.full_tokens,
    )  # fmt: skip


def _explore(
    views: Sequence[ServerView], request: RouteRequest, known: Knowledge, avoid: frozenset[str],
    rng: random.Random | None,
) -> RouteChoice | None:  # fmt: skip
    """The cheapest route through one never-measured server of the range, drawn at random; None when there is none
    or no route goes through it."""
    start, end = request.start, request.end
    unknown = sorted((v for v in views if v.peer_id in known.unmeasured and v.peer_id not in avoid
                      and v.start < end and v.end > start), key=lambda v: v.peer_id)  # fmt: skip
    if not unknown:
        return None
    pick = (rng or random.Random(0)).choice(unknown)
    lo, hi = max(pick.start, start), min(pick.end, end)
    # every other server of the picked one's blocks is left out, so the route must go through it
    others = {v.peer_id for v in views if v.peer_id != pick.peer_id and v.start < hi and v.end > lo}
    route = _find(views, request, known, avoid | others, rng)
    return None if route is None else RouteChoice(route, explored=pick.peer_id)
