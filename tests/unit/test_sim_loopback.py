"""The simulator's overloaded loopback swarm (sim/loopback.py simulated_overload, the prediction bench/overload.py
compares with a real swarm): slots bind, refusals come after the client's busy_wait_s, admitted users decode at the
batched step cost."""

from __future__ import annotations

import pytest

from swarmlm.config import ClientConfig
from swarmlm.sim.loopback import Overload, StepCosts, simulated_overload

SPANS = ((0, 15), (15, 30))
# 1 ms per block and token, no batching gain lost: 30 ms per token alone
COSTS = StepCosts(block_s=0.001, batch_slope=0.5, hop_s=0.0, client_s=0.0)
BUSY_WAIT_S = ClientConfig().busy_wait_s


def overload(slots: int, users: int, arrival_s: float, new_tokens: int) -> Overload:
    return Overload(SPANS, slots, users, arrival_s, prompt_tokens=4, new_tokens=new_tokens, cache_tokens=4096)


def test_room_for_everyone_refuses_no_one_and_decodes_at_the_batched_cost() -> None:
    outcomes = simulated_overload(overload(slots=4, users=4, arrival_s=0.0, new_tokens=20), COSTS)
    assert all(o.refused_after_s is None for o in outcomes)
    # four sessions in step: each token costs 30 ms * (1 + 0.5 * 3)
    assert [o.tokens_per_s() for o in outcomes] == pytest.approx([1 / (0.030 * 2.5)] * 4, rel=0.02)


def test_users_beyond_the_slots_are_refused_after_busy_wait_s() -> None:
    # sessions of ~1000 tokens x 45 ms: far longer than busy_wait_s, so no slot frees up for the late users
    outcomes = simulated_overload(overload(slots=2, users=5, arrival_s=0.1, new_tokens=1000), COSTS)
    refused = [o.refused_after_s for o in outcomes if o.refused_after_s is not None]
    assert len(refused) == 3
    assert refused == pytest.approx([BUSY_WAIT_S] * 3)
    assert all(len(o.token_times_s) == 1000 for o in outcomes[:2])


def test_a_freed_slot_takes_a_waiting_user() -> None:
    # 2 slots, sessions of ~1.4 s: the third user finds the swarm full and gets in once a session ends (the servers'
    # hint, bounded by the client, says when to ask again)
    outcomes = simulated_overload(overload(slots=2, users=3, arrival_s=0.0, new_tokens=30), COSTS)
    assert all(o.refused_after_s is None for o in outcomes)
    assert outcomes[2].token_times_s[0] > outcomes[0].token_times_s[-1]
