"""The simulator's placement rules: its shortcut of should_move answers exactly as should_move does, Petals' rule
moves a server off a crowded span and leaves a balanced swarm alone."""

from __future__ import annotations

import random

import pytest

from swarmlm.server.placement import block_throughputs, should_move
from swarmlm.sim.rules import PetalsRule, RandomRule, SwarmlmRule
from swarmlm.swarm.records import ServerRecord, ServerState


def record(start: int, end: int, throughput: float) -> ServerRecord:
    return ServerRecord(state=ServerState.ONLINE, start=start, end=end, throughput=throughput, dtype="bfloat16")


def random_swarm(rng: random.Random, blocks: int, servers: int) -> dict[str, ServerRecord]:
    swarm = {}
    for i in range(servers):
        n = rng.randint(1, blocks)
        start = rng.randrange(blocks - n + 1)
        swarm[f"p{i}"] = record(start, start + n, rng.choice([1.0, 2.5, 10.0]))
    return swarm


@pytest.mark.parametrize("servers", [2, 5, 40, 200])
def test_the_swarmlm_rule_moves_exactly_when_should_move_says_so(servers: int) -> None:
    rng = random.Random(servers)
    for _ in range(20):
        blocks = rng.randint(2, 12)
        swarm, quality = random_swarm(rng, blocks, servers), rng.choice([0.5, 0.75, 0.9])
        totals = block_throughputs(blocks, swarm)
        rule = SwarmlmRule(quality)
        for me in swarm:
            assert rule.move(blocks, me, swarm, totals) == should_move(blocks, me, swarm, quality)


def crowded() -> dict[str, ServerRecord]:
    # five servers on blocks 0:2 of 4, one on 2:4: block 2:4 is the bottleneck by far
    swarm = {f"p{i}": record(0, 2, 1.0) for i in range(5)}
    swarm["q"] = record(2, 4, 1.0)
    return swarm


def test_petals_rule_moves_a_server_off_a_crowded_span() -> None:
    swarm = crowded()
    rule = PetalsRule(0.75, random.Random(0))
    assert rule.move(4, "p0", swarm, block_throughputs(4, swarm)) == (2, 4)
    assert rule.move(4, "q", swarm, block_throughputs(4, swarm)) is None  # moving it would uncover blocks 2:4


def test_petals_rule_leaves_a_balanced_swarm_alone() -> None:
    swarm = {"a": record(0, 2, 1.0), "b": record(2, 4, 1.0), "c": record(0, 2, 1.0), "d": record(2, 4, 1.0)}
    rule = PetalsRule(0.75, random.Random(0))
    assert all(rule.move(4, me, swarm, block_throughputs(4, swarm)) is None for me in swarm)


def test_random_placement_draws_spans_inside_the_model_and_never_moves() -> None:
    rule = RandomRule(random.Random(0))
    spans = {rule.join(10, 3, {}, "me") for _ in range(200)}
    assert all(0 <= lo and hi == lo + 3 and hi <= 10 for lo, hi in spans) and len(spans) == 8
    assert rule.move(10, "p0", crowded(), [1.0] * 10) is None
