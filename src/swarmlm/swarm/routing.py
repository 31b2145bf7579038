"""Route planning: the cheapest chain of servers whose block spans cover a requested block range exactly once, for
least latency (inference sessions) or most throughput (batch work)."""

import math
import random
import statistics
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

# Fixed cost of every hop on top of its round trip: (de)serializing hidden states and dispatching the request.
DEFAULT_HOP_COST_S = 0.005
# Round trip assumed for a server this client has not measured: a typical wide-area RTT, so measured near servers win.
DEFAULT_LATENCY_S = 0.1
# An announced throughput is only a claim: until the client measures a server, its claim counts for at most this
# many times the swarm's median claim, so one server announcing an absurd figure cannot attract every route.
MAX_PRIOR_FACTOR = 2.0
# Relative slack when comparing float route costs, so alternatives equal up to rounding still count as ties.
_TIE_REL_TOL = 1e-9
# Announced load multiplies a server's cost by at most 1 + this: a claim may make it look busier, never faster.
MAX_LOAD_FACTOR = 1.0
# The throughput policy costs every request as one of this many tokens (the client's default max_tokens_per_request)
# unless told the client's own figure: batch work comes in full requests, whose compute outweighs round trips.
FULL_REQUEST_TOKENS = 1024
# Under the throughput policy each hop also costs this fraction of the route's compute, for moving all its tokens: a
# tenth keeps a route in one piece unless faster servers save more than that, and is above the default tie tolerance,
# so replicas are not cut into pieces that tie with whole ones (round trips alone are small next to full requests).
THROUGHPUT_HOP_SHARE = 0.1

# What a route minimizes: "latency" the time of this request (round trips, overheads, compute of its tokens), for
# token-by-token inference; "throughput" the time of a full request, hops' traffic included, for batch work.
Policy = Literal["latency", "throughput"]
# The client's routing option: a policy for everything, or "auto" (latency for inference, throughput otherwise).
ROUTING_MODES = ("auto", "latency", "throughput")


@dataclass(frozen=True)
class ServerView:
    """What a client knows about one server: the blocks it serves and how fast and far away it is."""

    peer_id: str  # opaque string id of the server
    start: int  # first block served
    end: int  # one past the last block served
    throughput: float  # measured tokens/s the server computes per block (higher = faster); > 0
    latency_s: float | None = None  # measured round trip to this server from this client, if known
    load: float = 0.0  # expected extra wait as a fraction of its cost (0: idle); clamped to [0, MAX_LOAD_FACTOR]
    cache_tokens_left: int | None = None  # announced free KV cache in block-tokens (None: not announced)


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
    hop_cost: float  # fixed cost of one hop: overhead plus round trip (and, for throughput, its traffic)
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


def policy_for(routing: str, inference: bool) -> Policy:
    """The policy of a route: `routing` itself, or for "auto" latency when the route opens inference sessions and
    throughput for batch work (forward, backward)."""
    if routing not in ROUTING_MODES:
        raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, not {routing!r}")
    if routing == "auto":
        return "latency" if inference else "throughput"
    return "latency" if routing == "latency" else "throughput"


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


def _load(server: ServerView) -> float:
    # Load comes from a server's own announcement: bounded, and never below idle, so it can only make a server look
    # worse than this client measured it. Records reject non-finite numbers; a NaN here counts as idle.
    if math.isnan(server.load):
        return 0.0
    return min(MAX_LOAD_FACTOR, max(0.0, server.load))


def _round_trip_hop(server: ServerView) -> float:
    return DEFAULT_HOP_COST_S + _latency(server)


def _group_servers(
    servers: Sequence[ServerView],
    start: int,
    end: int,
    banned: Collection[str],
    tokens: int,
    prefer: Collection[str],
    stickiness: float,
    hop_s: Callable[[ServerView], float] = _round_trip_hop,
) -> list[_Group]:
    """Servers of the range in cost classes; a hop on a server costs hop_s(server) before load and stickiness."""
    # Replicas usually share span and speed; costing each class once keeps the search fast with many replicas.
    classes: dict[tuple[int, int, float, float], set[str]] = {}
    for server in servers:
        if not _usable(server, banned) or server.end <= start or server.start >= end:
            continue
        # A busy server makes a request wait for the ones ahead of it: the whole hop, round trip included, costs more.
        # A preferred server (the one used last) is discounted so that it keeps its routes until another server is
        # cheaper by more than the stickiness margin.
        scale = (1.0 + _load(server)) / (1.0 + stickiness if server.peer_id in prefer else 1.0)
        key = (
            max(server.start, start),
            min(server.end, end),
            hop_s(server) * scale,
            tokens / server.throughput * scale,
        )
        classes.setdefault(key, set()).add(server.peer_id)
    return [_Group(lo, hi, hop, blk, tuple(sorted(peers))) for (lo, hi, hop, blk), peers in classes.items()]


def _dominates(better: _Group, worse: _Group, tolerance: float) -> bool:
    # `better` can run every hop `worse` can, never costs more (by more than the tie tolerance) and costs strictly
    # less per hop or per block: `worse` is then never on a cheapest route, nor within the tolerance of one for the
    # hops it would run. Equal costs are not dominance, so replicas stay available as tie choices.
    grow = 1.0 + tolerance
    return (
        better.lo <= worse.lo
        and better.hi >= worse.hi
        and better.hop_cost * grow <= worse.hop_cost
        and better.block_cost * grow <= worse.block_cost
        and (better.hop_cost < worse.hop_cost or better.block_cost < worse.block_cost)
    )


def _drop_dominated(groups: Sequence[_Group], tolerance: float) -> tuple[list[_Group], dict[int, list[int]]]:
    """Groups that no other group dominates, and for each block the indices of those among them containing it.

    Usually only a handful survive, which keeps the sweep in _route_costs near O(blocks) even with many servers.
    """
    kept: list[_Group] = []
    covering: dict[int, list[int]] = {}
    # In this order a dominating group always precedes the groups it dominates, and dominance is transitive, so
    # comparing with the kept groups alone is enough; a dominating group contains the dominated one's first block,
    # so only the kept groups covering that block need comparing, which stays cheap for many short, disjoint spans.
    for group in sorted(groups, key=lambda g: (g.hop_cost, g.block_cost, g.lo, -g.hi)):
        if any(_dominates(kept[other], group, tolerance) for other in covering.get(group.lo, ())):
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
    groups: Sequence[_Group],
    enders: Sequence[int],
    cost: Sequence[float],
    j: int,
    rng: random.Random | None,
    budget: float,
    prefer: frozenset[str],
) -> tuple[str, int, float]:
    """Pick the last hop (peer, origin, excess) of a route ending at j that costs at most `budget` more than the
    cheapest one; excess is how much more it costs. A preferred peer among the candidates wins over the draw.

    enders are the indices of the groups containing block j - 1: exactly those that can run a hop ending at j.
    """
    slack = _TIE_REL_TOL * max(1.0, cost[j]) + budget
    ties: list[tuple[str, int, float]] = []
    for group in (groups[g] for g in enders):
        for i in range(group.lo, j):
            excess = cost[i] + group.hop_cost + (j - i) * group.block_cost - cost[j]
            if excess <= slack:
                ties.extend((peer, i, max(0.0, excess)) for peer in group.peers)
    # The origin that produced cost[j] reproduces it exactly, so `ties` is never empty for a reachable j.
    # Stickiness: drawing among near-ties must not move a client off the server it used last.
    ties = [tie for tie in ties if tie[0] in prefer] or ties
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


def _least_compute(
    servers: Sequence[ServerView],
    start: int,
    end: int,
    banned: frozenset[str],
    tokens: int,
    prefer: frozenset[str],
    stickiness: float,
) -> float:
    """Compute of `tokens` tokens over [start, end) on the route that needs the least, hops free (inf: uncovered)."""
    free = _group_servers(servers, start, end, banned, tokens, prefer, stickiness, hop_s=lambda server: 0.0)
    groups, covering = _drop_dominated(free, 0.0)
    return _route_costs(groups, covering, start, end)[end]


def find_route(
    servers: Sequence[ServerView],
    start: int,
    end: int,
    *,
    banned: Collection[str] = (),
    tokens: int = 1,
    rng: random.Random | None = None,
    tie_tolerance: float = 0.0,
    prefer: Collection[str] = (),
    stickiness: float = 0.0,
    policy: Policy = "latency",
    full_tokens: int = FULL_REQUEST_TOKENS,
) -> list[RouteSpan] | None:
    """Cheapest chain of hops applying every block of [start, end) exactly once; None if some block is uncovered.

    Under the latency policy a hop on server s running k blocks costs (DEFAULT_HOP_COST_S + latency +
    k * tokens / s.throughput) times (1 + its bounded load), so routes with fewer hops and nearer, idler servers win,
    and for large inputs faster servers win. A hop may begin at any block inside the server's span.

    The throughput policy costs the request as one of at least full_tokens tokens (a full request of batch work),
    and each hop also THROUGHPUT_HOP_SHARE times the least compute of such a request over [start, end): servers with
    more throughput per block win unless round trips are comparable to what they save, and an extra hop must save
    more than that share. The route then does not depend on the request's size (up to full_tokens).

    With rng, the route is drawn at random among those costing at most tie_tolerance (a fraction) more than the
    cheapest, so clients whose measurements differ by jitter still spread over replicas; without rng the choice is
    deterministic and cheapest (smallest peer_id, then longest final hop). Servers in `prefer` (those the caller
    used last) count as cheaper by the factor 1 + stickiness, so a route keeps them until another server is cheaper
    by more than that margin; the route then costs at most (1 + stickiness) (1 + tie_tolerance) times the cheapest.
    """
    _check_range(start, end)
    if tokens < 0 or full_tokens < 0:
        raise ValueError(f"tokens and full_tokens must be >= 0, got {tokens}, {full_tokens}")
    if not (tie_tolerance >= 0 and stickiness >= 0 and math.isfinite(tie_tolerance + stickiness)):
        raise ValueError(f"tie_tolerance and stickiness must be finite and >= 0, got {tie_tolerance}, {stickiness}")
    if start == end:
        return []
    tolerance = tie_tolerance if rng is not None else 0.0
    # Banned and preferred ids are looked up once per server; sets keep that O(1) whatever collection was passed.
    prefer, banned = frozenset(prefer), frozenset(banned)
    traffic_s = 0.0  # moving a hop's tokens, on top of its round trip: counted for the full requests of throughput
    if policy == "throughput":
        tokens = max(tokens, full_tokens)
        compute = _least_compute(servers, start, end, banned, tokens, prefer, stickiness)
        if math.isinf(compute):
            return None
        traffic_s = THROUGHPUT_HOP_SHARE * compute
    found = _group_servers(
        servers, start, end, banned, tokens, prefer, stickiness, lambda server: _round_trip_hop(server) + traffic_s
    )
    groups, covering = _drop_dominated(found, tolerance)
    cost = _route_costs(groups, covering, start, end)
    if math.isinf(cost[end]):
        return None
    # Each chosen hop may cost more than the cheapest by what is left of the route's slack, so the whole route stays
    # within the tolerance of the cheapest however many hops it has.
    budget = tolerance * cost[end]
    hops: list[RouteSpan] = []
    j = end
    while j > start:
        peer, i, excess = _choose_hop(groups, covering[j - 1], cost, j, rng, budget, prefer)
        budget = max(0.0, budget - excess)
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
