"""An inference session's recovery plans without sockets: which hops a failure keeps, which it routes again from
which block with which history replayed, and which links a failed push closes and whom it blames."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from swarmlm.client.session_plan import (
    PushFailure,
    Rebuild,
    Reopen,
    blame_in_replay,
    plan_push_failure,
    plan_rebuild,
    plan_reopen,
    plan_repair,
)
from swarmlm.client.session_state import SessionState
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.swarm.routing import RouteSpan
from tests.unit.test_session_state import Link, link, session, step


def as_received(inputs: SpanTensors, hop: int) -> SpanTensors:
    """The step as hop `hop` got it: the previous hop's output, told apart here by an offset per hop."""
    return replace(inputs, hidden=inputs.hidden + 100 * hop)


def run(state: SessionState[Link], inputs: SpanTensors) -> None:
    """Every hop runs the step on its own input and the session commits it."""
    for index, hop in enumerate(state.route):
        hop.state.ran(as_received(inputs, index), state.position)
    state.commit(inputs)


def replayed_tokens(plan: Rebuild, max_tokens: int = 1024) -> int:
    return sum(request.hidden.shape[1] for request in plan.requests(max_tokens))


def replay_into(hops: list[Link], plan: Rebuild) -> None:
    """What the links do with a rebuild plan once they are open: each replays the steps on what the one before gave."""
    for request in plan.requests(max_tokens=1024):
        for index, hop in enumerate(hops):
            hop.state.replayed(as_received(request, index + 1))


def three_hops_after(*steps: SpanTensors) -> SessionState[Link]:
    state = session((0, 2), (2, 4), (4, 6))
    for inputs in steps:
        run(state, inputs)
    return state


@pytest.mark.parametrize("failed", [0, 1, 2])
def test_a_lost_hop_is_rebuilt_from_its_own_history_and_the_others_are_kept(failed: int) -> None:
    state = three_hops_after(step(0, 4), step(4, 2))
    for hop in state.route[:failed]:  # hops before the failure ran the failed step: their next step cuts it back
        hop.state.ran(step(6, 1), state.position)
    state.route[failed].state.broken = True
    plan = plan_repair(state)
    assert [entry is None for entry in plan] == [index != failed for index in range(3)]
    rebuild = plan[failed]
    assert rebuild is not None and rebuild.lost == state.route[failed].span
    assert (rebuild.start, rebuild.end) == (2 * failed, 2 * failed + 2)
    # the replay is what that hop's cache had committed, as it got it (its own input), never the failed step
    assert [s.hidden[0, 0, 0].item() for s in rebuild.history] == [100.0 * failed, 4 + 100.0 * failed]
    assert replayed_tokens(rebuild) == state.position == 6
    assert [r.hidden.shape[1] for r in rebuild.requests(max_tokens=8)] == [4, 2]  # 2 rows: 4 tokens a request


def test_hops_that_reordered_their_cache_rows_are_rebuilt_with_the_lost_one() -> None:
    state = three_hops_after(step(0, 3))
    for hop in state.route[:2]:  # beam search reordered their rows before the last hop failed
        hop.state.ran(step(3, 1, hypo_ids=[1, 0]), state.position)
    state.route[2].state.broken = True
    plan = plan_repair(state)
    assert [entry is not None for entry in plan] == [True, True, True]
    assert all(replayed_tokens(entry) == 3 for entry in plan if entry is not None)  # the reorder is not replayed


def test_a_healthy_route_needs_no_rebuild_and_a_rollback_replays_only_the_kept_tokens() -> None:
    state = three_hops_after(step(0, 4), step(4, 3))
    assert plan_repair(state) == [None, None, None]
    state.rollback(5)
    state.route[1].state.broken = True
    rebuild = plan_repair(state)[1]
    assert rebuild is not None and replayed_tokens(rebuild) == 5


def test_a_failure_during_replay_leaves_the_plan_to_replay_it_all_again_elsewhere() -> None:
    state = three_hops_after(step(0, 2), step(2, 1), step(3, 1))
    state.route[1].state.broken = True
    (plan,) = [entry for entry in plan_repair(state) if entry is not None]
    failed_replacement = [link(2, 4, "new-x")]
    request = plan.requests(max_tokens=2)[0]
    failed_replacement[0].state.replayed(request)  # its first request went through, then its server died
    # the plan comes from the lost hop, not the half-built replacement: the next try replays the whole history
    assert plan_rebuild(state.route[1]) == plan and replayed_tokens(plan, max_tokens=2) == 4
    assert blame_in_replay(plan, [hop.span for hop in failed_replacement], "new-x") == failed_replacement[0].span
    assert blame_in_replay(plan, [hop.span for hop in failed_replacement], None) == plan.lost


def test_a_repair_interrupted_by_a_failed_rebuild_is_planned_again_from_where_it_stopped() -> None:
    state = three_hops_after(step(0, 3))
    for hop in state.route:
        hop.state.ran(step(3, 1, hypo_ids=[1, 0]), state.position)  # all three must be rebuilt
    first = plan_repair(state)
    # the executor rebuilt hop 0 and put its replacement in its place, then hop 1's rebuild failed (its link dropped)
    replacement = link(0, 2, "new-0")
    replay_into([replacement], first[0] or pytest.fail("hop 0 is rebuilt"))
    state.splice(0, 1, [replacement])
    state.route[1].state.broken = True
    again = plan_repair(state)
    assert again[0] is None and again[1] is not None and again[2] is not None
    assert replacement.state.tokens == state.position == 3


def test_a_span_split_across_two_replacement_servers_is_repaired_one_server_at_a_time() -> None:
    state = session((0, 6))
    run(state, step(0, 3))
    run(state, step(3, 2))
    state.route[0].state.broken = True
    (plan,) = plan_repair(state)
    assert plan is not None and (plan.start, plan.end) == (0, 6)
    # the new route for blocks 0:6 has two servers: the second failed to open, so it is routed again from block 3
    assert plan_reopen([RouteSpan("a", 0, 3), RouteSpan("b", 3, 6)], [False, True]) == Reopen(keep=1, from_block=3)
    assert plan_reopen([RouteSpan("a", 0, 3), RouteSpan("b", 3, 6)], [True, True]) == Reopen(keep=0, from_block=0)
    assert plan_reopen([RouteSpan("a", 0, 3), RouteSpan("c", 3, 6)], [False, False]) is None
    halves = [link(0, 3, "a"), link(3, 6, "c")]
    replay_into(halves, plan)
    state.splice(0, 1, halves)
    assert state.covers() and [hop.state.tokens for hop in halves] == [5, 5]
    halves[1].state.broken = True  # later the second half's server dies: only its blocks are routed again
    first, second = plan_repair(state)
    assert first is None and second is not None and (second.start, second.end) == (3, 6)
    assert second.history == tuple(halves[1].state.history)  # what that server got: the first half's output
    assert [s.hidden[0, 0, 0].item() for s in second.history] == [200.0]  # one merged request of the 5 tokens


def pushed(pending: list[bool]) -> SessionState[Link]:
    """Hops a, b, c after a pushed step failed: those marked pending ran it."""
    state = session((0, 2), (2, 4), (4, 6))
    for hop, peer in zip(state.route, "abc", strict=True):
        hop.span = RouteSpan(peer, hop.span.start, hop.span.end)
    for hop, ran in zip(state.route, pending, strict=True):
        if ran:
            hop.state.ran(step(0, 1), 0)
    return state


@pytest.mark.parametrize(
    ("pending", "index", "call_failed", "error_peer", "expected"),
    [
        # b's call failed naming c, which b pushed to: c is blamed, everything from b on is closed
        ([True, True, False], 1, True, "c", PushFailure(drop_from=1, blame=2)),
        # b's stream failed naming a: a never pushed, so its cache is lost to us as well and a is blamed
        ([True, False, False], 1, True, "a", PushFailure(drop_from=0, blame=0)),
        # b itself failed after running the step: it is cut back by its next step, the rest is closed
        ([True, True, False], 1, True, "b", PushFailure(drop_from=2, blame=1)),
        ([True, False, False], 1, True, "b", PushFailure(drop_from=1, blame=1)),
        # the first call failed naming nobody: the first server is blamed
        ([False, False, False], 0, True, None, PushFailure(drop_from=0, blame=0)),
        # a ran the step but could not push on: b is only asked whether it is there
        ([True, False, False], 0, False, None, PushFailure(drop_from=1, ask=1)),
        # the last hop cannot push on to anyone: nobody to ask
        ([True, True, True], 2, False, None, PushFailure(drop_from=3)),
    ],
)
def test_a_failed_push_closes_what_may_still_get_the_step_and_blames_one_server(
    pending: list[bool], index: int, call_failed: bool, error_peer: str | None, expected: PushFailure
) -> None:
    assert plan_push_failure(pushed(pending), index, call_failed, error_peer) == expected


def test_rebuild_plans_compare_by_what_they_replay() -> None:
    state = session((0, 2))
    run(state, step(0, 2))
    plan = plan_rebuild(state.route[0])
    assert plan == Rebuild(RouteSpan("peer0:2", 0, 2), tuple(state.route[0].state.history))
    assert torch.equal(plan.requests(max_tokens=16)[0].hidden, step(0, 2).hidden)
