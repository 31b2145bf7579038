"""Which blocks a server should serve: pure functions of a swarm view (peer id -> record), tested without sockets."""

from __future__ import annotations

from collections.abc import Mapping

from swarmlm.config import ServerConfig
from swarmlm.errors import SwarmError
from swarmlm.swarm.records import ServerRecord, ServerState

Span = tuple[int, int]
# servers that hold (or are about to hold) their span: the ones placement counts
SERVING = (ServerState.ONLINE, ServerState.JOINING)


def block_throughputs(num_blocks: int, servers: Mapping[str, ServerRecord], exclude: str | None = None) -> list[float]:
    """Total throughput of the serving servers covering each block (0.0 where no server covers it)."""
    totals = [0.0] * num_blocks
    for peer_id, record in servers.items():
        if peer_id == exclude or record.state not in SERVING:
            continue
        for block in range(min(record.start, num_blocks), min(record.end, num_blocks)):
            totals[block] += record.throughput
    return totals


def weakest_start(throughputs: list[float], n: int) -> int:
    """Start of the n consecutive blocks where the swarm is weakest: compared weakest block first, then the next
    weakest, and so on (a window with more uncovered blocks wins); ties go to the lowest index."""
    if not 1 <= n <= len(throughputs):
        raise ValueError(f"cannot place {n} blocks in a model of {len(throughputs)}")
    return min(range(len(throughputs) - n + 1), key=lambda i: (sorted(throughputs[i : i + n]), i))


def choose_span(num_blocks_total: int, n: int, servers: Mapping[str, ServerRecord], me: str | None = None) -> Span:
    """The n blocks a new server should serve, given the swarm's records (its own record, under `me`, ignored)."""
    start = weakest_start(block_throughputs(num_blocks_total, servers, exclude=me), n)
    return start, start + n


def claimed_first(me: str, mine: ServerRecord, servers: Mapping[str, ServerRecord]) -> bool:
    """Whether another joining server claimed the very span of `mine` before us: earlier `since`, ties broken by
    peer id. Every server computes this alike from what it reads, so of contenders that see each other exactly one
    keeps the span; one that did not see us yet claimed it first. Online servers were in the view we chose from."""
    span = (mine.start, mine.end)
    for peer_id, record in servers.items():
        if peer_id == me or record.state != ServerState.JOINING or (record.start, record.end) != span:
            continue
        if (record.since, peer_id) < (mine.since, me):
            return True
    return False


def estimate_throughput(servers: Mapping[str, ServerRecord], default: float = 1.0) -> float:
    """A joining server's throughput before it has measured itself: the mean of the serving servers' claims."""
    claims = [record.throughput for record in servers.values() if record.state in SERVING]
    return sum(claims) / len(claims) if claims else default


def bottleneck(throughputs: list[float]) -> float:
    """The swarm's throughput through the whole model: that of its weakest block."""
    return min(throughputs, default=0.0)


def should_move(num_blocks_total: int, me: str, servers: Mapping[str, ServerRecord], quality: float) -> Span | None:
    """The span this server (whose record is servers[me]) should move to, or None to stay.

    It moves when its best span would raise the swarm's bottleneck enough: current < quality * after the move (as
    in Petals; quality < 1 keeps servers from moving back and forth over small differences).
    """
    mine = servers[me]
    n = mine.end - mine.start
    others = block_throughputs(num_blocks_total, servers, exclude=me)
    start = weakest_start(others, n)
    if start == mine.start:
        return None
    current = block_throughputs(num_blocks_total, servers)
    after = [t + (mine.throughput if start <= b < start + n else 0.0) for b, t in enumerate(others)]
    if bottleneck(current) < quality * bottleneck(after):
        return start, start + n
    return None


def requested_span(config: ServerConfig, num_blocks_total: int) -> Span:
    """The span given with --blocks, or a placeholder of --num-blocks blocks until the swarm is read."""
    if config.num_blocks is not None:
        if not 1 <= config.num_blocks <= num_blocks_total:
            raise SwarmError(f"--num-blocks {config.num_blocks}: the model has {num_blocks_total} blocks")
        return 0, config.num_blocks
    if not 0 <= config.start_block < config.end_block <= num_blocks_total:
        raise SwarmError(
            f"--blocks {config.start_block}:{config.end_block} is outside the model's blocks 0:{num_blocks_total}"
        )
    return config.start_block, config.end_block
