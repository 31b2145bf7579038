"""Route planning: the cheapest chain of servers whose block spans cover a requested block range exactly once."""

import math
import random
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

# Fixed cost of every hop on top of its round trip: (de)serializing hidden states and dispatching the request.
DEFAULT_HOP_COST_S = 0.005
# Round trip assumed for a server this client has not measured: a typical wide-area RTT, so measured near servers win.
DEFAULT_LATENCY_S = 0.1
# An announced throughput is only a claim: until the client measures a server, its claim counts for at most this
# many times the swarm's median claim, so one server announcing an absurd figure cannot attract every route.
MAX_PRIOR_FACTOR = 2.0
# Relative slack when comparing float route costs, so alternatives equal up to rounding still count as ties.
_TIE_REL_TOL = 1e-9


@dataclass(frozen=True)
class ServerView:
    """What a client knows about one server: the blocks it serves and how fast and far away it is."""

    peer_id: str  # opaque string id of the server
    start: int  # first block served
    end: int  # one past the last block served
    throughput: float  # measured tokens/s the server computes per block (higher = faster); > 0
    latency_s: float | None = None  # measured round trip to this server from this client, if known


@dataclass(frozen=True)
class RouteSpan:
    """One hop of a route: run blocks [start, end) on peer_id."""

    peer_id: str
    start: int
    end: int


class _Group(NamedTuple):
    """Servers that are interchangeable for costing: same clipped span, per-hop cost and per-block cost."""

    lo: int  # first block of the requested range this group can run
    hi: int  # one past the last block of the requested range this group can run
    hop_cost: float  # fixed cost of one hop: overhead plus round trip
    block_cost: float  # cost of one block for the requested number of tokens
    peers: tuple[str, ...]  # sorted, without duplicates, so random tie-breaking is fair and reproducible


def bounded_priors(announced: Sequence[float]) -> list[float]:
    """Announced throughputs clamped to MAX_PRIOR_FACTOR times their median (the lower median, over the valid ones).

    Invalid entries (not finite or not positive) are returned unchanged: routing ignores such servers anyway.
    """
    valid = [t for t in announced if math.isfinite(t) and t > 0]
    if not valid:
        return list(announced)
    cap = MAX_PRIOR_FACTOR * statistics.median_low(valid)
    return [min(t, cap) if math.isfinite(t) and t > 0 else t for t in announced]


def _check_range(start: int, end: int) -> None:
    if start < 0 or end < 0 or start > end:
        raise ValueError(f"invalid block range [{start}, {end}): need 0 <= start <= end")


def _usable(server: ServerView, banned: Collection[str]) -> bool:
    # Records come from the network: a span that is empty or a throughput that is not a positive number cannot be
    # costed, so such a server is ignored by routing and by missing_blocks alike (they must agree).
    if server.peer_id in banned or server.end <= server.start:
        return False
    return math.isfinite(server.throughput) and server.throughput > 0


def _latency(server: ServerView) -> float:
    # A measured 0.0 is a valid (if optimistic) measurement, so only None means "unknown"; a negative clock
    # artefact is clamped rather than allowed to make a hop look better than free.
    if server.latency_s is None or not math.isfinite(server.latency_s):
        return DEFAULT_LATENCY_S
    return max(0.0, server.latency_s)


def _group_servers(
    servers: Sequence[ServerView], start: int, end: int, banned: Collection[str], tokens: int
) -> list[_Group]:
    # Replicas usually share span and speed; costing each class once keeps the search fast with many replicas.
    classes: dict[tuple[int, int, float, float], set[str]] = {}
    for server in servers:
        if not _usable(server, banned) or server.end <= start or server.start >= end:
            continue
        key = (
            max(server.start, start),
            min(server.end, end),
            DEFAULT_HOP_COST_S + _latency(server),
            tokens / server.throughput,
        )
        classes.setdefault(key, set()).add(server.peer_id)
    return [_Group(lo, hi, hop, blk, tuple(sorted(peers))) for (lo, hi, hop, blk), peers in classes.items()]


def _dominates(better: _Group, worse: _Group) -> bool:
    # `better` can run every hop `worse` can, never costs more and costs strictly less per hop or per block: `worse`
    # is then never on a cheapest route. Equal costs are not dominance, so replicas stay available as tie choices.
    return (
        better.lo <= worse.lo
        and better.hi >= worse.hi
        and better.hop_cost <= worse.hop_cost
        and better.block_cost <= worse.block_cost
        and (better.hop_cost < worse.hop_cost or better.block_cost < worse.block_cost)
    )


def _drop_dominated(groups: Sequence[_Group]) -> tuple[list[_Group], dict[int, list[int]]]:
    """Groups that no other group dominates, and for each block the indices of those among them containing it.

    Usually only a handful survive, which keeps the sweep in _route_costs near O(blocks) even with many servers.
    """
    kept: list[_Group] = []
    covering: dict[int, list[int]] = {}
    # In this order a dominating group always precedes the groups it dominates, and dominance is transitive, so
    # comparing with the kept groups alone is enough; a dominating group contains the dominated one's first block,
    # so only the kept groups covering that block need comparing, which stays cheap for many short, disjoint spans.
    for group in sorted(groups, key=lambda g: (g.hop_cost, g.block_cost, g.lo, -g.hi)):
        if any(_dominates(kept[other], group) for other in covering.get(group.lo, ())):
            continue
        for block in range(group.lo, group.hi):
            covering.setdefault(block, []).append(len(kept))
        kept.append(group)
    return kept, covering


def _route_costs(groups: Sequence[_Group], covering: dict[int, list[int]], start: int, end: int) -> list[float]:
    """Cheapest cost to have applied blocks [start, j) for every j (indexed by j); inf where unreachable.

    Hops only move forward, so positions form a DAG and one sweep in position order is an exact shortest-path
    search. A hop from i to j on group g costs cost[i] + hop_cost + (j - i) * block_cost, so for each group the best
    origin is the i minimising cost[i] - i * block_cost, which can be kept as a running minimum: O(sum of spans).
    """
    cost = [math.inf] * (end + 1)
    cost[start] = 0.0
    # Plain lists instead of attribute lookups: this loop is the hot path of every route request.
    hop_costs = [g.hop_cost for g in groups]
    block_costs = [g.block_cost for g in groups]
    best_key = [math.inf] * len(groups)
    best_origin = [0] * len(groups)
    for j in range(start + 1, end + 1):
        i = j - 1
        here = cost[i]
        best = math.inf
        # The groups containing block j - 1 are exactly those that can run a hop ending at j.
        for g in covering.get(i, ()):
            block_cost = block_costs[g]
            key = here - i * block_cost
            if key < best_key[g]:
                best_key[g], best_origin[g] = key, i
            if best_key[g] == math.inf:
                continue  # no reachable origin inside this group's span yet
            origin = best_origin[g]
            # Recomputed from the origin rather than from the key, so the chosen path's cost is bit-exact.
            candidate = cost[origin] + hop_costs[g] + (j - origin) * block_cost
            if candidate < best:
                best = candidate
        cost[j] = best
    return cost


def _choose_hop(
    groups: Sequence[_Group], enders: Sequence[int], cost: Sequence[float], j: int, rng: random.Random | None
) -> tuple[str, int]:
    """Pick the last hop (peer, origin) of a cheapest route ending at j, among all equally cheap ones.

    enders are the indices of the groups containing block j - 1: exactly those that can run a hop ending at j.
    """
    slack = _TIE_REL_TOL * max(1.0, cost[j])
    ties: list[tuple[str, int]] = []
    for group in (groups[g] for g in enders):
        for i in range(group.lo, j):
            if cost[i] + group.hop_cost + (j - i) * group.block_cost <= cost[j] + slack:
                ties.extend((peer, i) for peer in group.peers)
    # The origin that produced cost[j] reproduces it exactly, so `ties` is never empty for a reachable j.
    if rng is None:
        return min(ties)
    return rng.choice(sorted(ties))


def _merge_same_peer(hops: Sequence[RouteSpan]) -> list[RouteSpan]:
    # One request that runs more blocks beats two back-to-back requests to the same server.
    merged: list[RouteSpan] = []
    for hop in hops:
        if merged and merged[-1].peer_id == hop.peer_id and merged[-1].end == hop.start:
            merged[-1] = RouteSpan(hop.peer_id, merged[-1].start, hop.end)
        else:
            merged.append(hop)
    return merged


def find_route(
    servers: Sequence[ServerView],
    start: int,
    end: int,
    *,
    banned: Collection[str] = (),
    tokens: int = 1,
    rng: random.Random | None = None,
) -> list[RouteSpan] | None:
    """Cheapest chain of hops applying every block of [start, end) exactly once; None if some block is uncovered.

    A hop on server s running k blocks costs DEFAULT_HOP_COST_S + latency + k * tokens / s.throughput, so routes
    with fewer hops and nearer servers win, and for large inputs faster servers win. A hop may begin at any block
    inside the server's span. With rng, ties between equally cheap routes are broken at random (spreading load over
    replicas); without it the choice is deterministic (smallest peer_id, then longest final hop).
    """
    _check_range(start, end)
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if start == end:
        return []
    # Banned ids are looked up once per server; a set keeps that O(1) whatever collection the caller passed.
    groups, covering = _drop_dominated(_group_servers(servers, start, end, frozenset(banned), tokens))
    cost = _route_costs(groups, covering, start, end)
    if math.isinf(cost[end]):
        return None
    hops: list[RouteSpan] = []
    j = end
    while j > start:
        peer, i = _choose_hop(groups, covering[j - 1], cost, j, rng)
        hops.append(RouteSpan(peer, i, j))
        j = i
    hops.reverse()
    return _merge_same_peer(hops)


def missing_blocks(servers: Sequence[ServerView], start: int, end: int, *, banned: Collection[str] = ()) -> list[int]:
    """Sorted block indices in [start, end) that no usable, non-banned server covers."""
    _check_range(start, end)
    banned = frozenset(banned)
    covered = [False] * (end - start)
    for server in servers:
        if _usable(server, banned):
            for block in range(max(server.start, start), min(server.end, end)):
                covered[block - start] = True
    return [start + offset for offset, is_covered in enumerate(covered) if not is_covered]
