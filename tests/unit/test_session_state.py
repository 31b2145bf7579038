"""An inference session's state without sockets: steps split to fit a request, what each span's cache holds after
a step, a failure or a rollback, which spans a failed step leaves to rebuild, and when a step may be pushed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from swarmlm.client.session_state import SessionState, SpanState, pushable, split_step
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.swarm.routing import RouteSpan


@dataclass
class Link:
    """A hop of a session's route as plain data: its server and blocks, and its cache's state (lost once broken, as
    a dropped link is)."""

    span: RouteSpan
    state: SpanState

    @property
    def lost(self) -> bool:
        return self.state.broken


def step(begin: int, seq: int, batch: int = 2, hypo_ids: list[int] | None = None) -> SpanTensors:
    hidden = torch.arange(begin, begin + seq, dtype=torch.float32).expand(batch, seq)[..., None]  # (batch, seq, 1)
    return SpanTensors(
        hidden,
        attention_mask=torch.ones(batch, begin + seq, dtype=torch.int64),
        position_ids=torch.arange(begin, begin + seq).expand(batch, seq),
        hypo_ids=None if hypo_ids is None else torch.tensor(hypo_ids),
    )


def link(start: int, end: int, peer: str | None = None) -> Link:
    return Link(RouteSpan(peer or f"peer{start}:{end}", start, end), SpanState(start, end))


def session(*bounds: tuple[int, int], max_length: int = 16, push: bool = True) -> SessionState[Link]:
    """A session over blocks from the first bound's start to the last's end, routed over one hop per bound."""
    state: SessionState[Link] = SessionState(bounds[0][0], bounds[-1][1], max_length, push=push)
    state.splice(0, 0, [link(start, end) for start, end in bounds])
    return state


def run(state: SessionState[Link], inputs: SpanTensors) -> None:
    """Every span runs the step and the session commits it, as a successful step does."""
    for span in state.spans():
        span.ran(inputs, state.position)
    state.commit(inputs)


def test_a_long_step_is_split_into_sub_steps_that_each_carry_their_mask_and_positions() -> None:
    whole = step(3, 7, hypo_ids=[1, 0])
    parts = split_step(whole, max_tokens=6, past=3)  # 3 tokens a row for 2 rows
    assert [part.hidden.shape[1] for part in parts] == [3, 3, 1]
    assert torch.equal(torch.cat([part.hidden for part in parts], dim=1), whole.hidden)
    assert [part.attention_mask.shape[1] for part in parts] == [6, 9, 10]  # (batch, past + tokens so far)
    assert parts[2].position_ids.tolist() == [[9], [9]]
    assert parts[0].hypo_ids.tolist() == [1, 0] and parts[1].hypo_ids is None and parts[2].hypo_ids is None
    assert split_step(whole, max_tokens=14, past=3) == [whole]
    assert [p.hidden.shape[1] for p in split_step(step(0, 3), max_tokens=1, past=0)] == [1, 1, 1]  # a row at least


def test_steps_that_every_span_ran_join_the_histories_and_advance_the_position() -> None:
    state = session((0, 2), (2, 6))
    spans = state.spans()
    run(state, step(0, 4))
    run(state, step(4, 0))  # an empty step that only cut the caches leaves no trace
    run(state, step(4, 0, hypo_ids=[1, 0]))  # a reorder without tokens stays: the rows stay reordered
    run(state, step(4, 2))
    assert state.position == 6
    assert all(span.tokens == 6 and span.pending is None for span in spans)
    assert [s.hidden.shape[1] for s in spans[1].history] == [4, 0, 2] and spans[1].history[1].hypo_ids is not None


def test_a_commit_refuses_a_span_that_ran_nothing_and_keeps_the_others_as_they_were() -> None:
    state = session((0, 2), (2, 6))
    spans = state.spans()
    spans[0].ran(step(0, 3), 0)
    with pytest.raises(RuntimeError, match="inference span 2:6 ran no step"):
        state.commit(step(0, 3))
    assert state.position == 0 and spans[0].history == [] and spans[0].pending is not None


def test_a_span_is_cut_back_by_its_next_step_unless_it_reordered_its_cache_or_was_lost() -> None:
    state = session((0, 3), (3, 6), (6, 9))
    spans = state.spans()
    run(state, step(0, 4))
    spans[0].ran(step(4, 2), state.position)  # a step the first span ran before the second failed it
    assert spans[0].behind(4, lost=False) and not spans[2].behind(4, lost=False)
    assert spans[2].behind(4, lost=True)
    assert spans[0].must_rebuild(lost=False) is False  # kept: its next step cuts it back
    spans[0].settle_failed_step()
    assert spans[0].pending is None and spans[0].tokens == 6 and spans[0].start_from(4) == 4
    assert spans[2].start_from(4) is None
    spans[1].ran(step(4, 1, hypo_ids=[1, 0]), state.position)
    assert spans[1].must_rebuild(lost=False) is True  # its cache rows are reordered: rebuilt from history
    spans[1].settle_failed_step()
    assert spans[1].pending is not None  # a reorder is not forgotten: the server cannot undo it
    assert spans[2].must_rebuild(lost=True) is True


def test_a_rollback_cuts_every_history_and_refuses_positions_it_does_not_hold() -> None:
    state = session((0, 2), (2, 6))
    spans = state.spans()
    run(state, step(0, 4))
    run(state, step(4, 3))
    state.rollback(5)
    assert state.position == 5
    assert [[s.hidden.shape[1] for s in span.history] for span in spans] == [[4, 1], [4, 1]]
    assert spans[0].tokens == 7 and spans[0].start_from(5) == 5  # the server cuts its cache at the next step
    for tokens in (6, -1):
        with pytest.raises(ValueError, match=r"position must lie in \[0, 5\]"):
            state.rollback(tokens)


def test_steps_the_session_cannot_hold_are_refused() -> None:
    state = SessionState(0, 6, max_length=8, position=6, batch_size=2)
    state.check_step(step(6, 2))
    with pytest.raises(ValueError, match="9 tokens exceed the session's max_length 8"):
        state.check_step(step(6, 3))
    with pytest.raises(ValueError, match="step has batch 3; the session was opened for batch 2"):
        state.check_step(step(6, 1, batch=3))


def test_an_empty_step_makes_no_call_unless_it_reorders_or_a_span_is_behind() -> None:
    state = session((0, 2), (2, 6))
    run(state, step(0, 4))
    assert state.is_noop(step(4, 0))
    assert not state.is_noop(step(4, 0, hypo_ids=[1, 0]))
    state.route[1].state.broken = True
    assert not state.is_noop(step(4, 0))
    state.route[1].state.broken = False
    state.rollback(3)
    assert not state.is_noop(step(3, 0))  # the caches still hold 4 tokens: cut them


def test_only_plain_steps_over_a_whole_ready_route_of_several_spans_are_pushed() -> None:
    state = session((0, 2), (2, 6))
    assert pushable(step(0, 2), state)
    assert not pushable(step(0, 0), state)  # nothing to push
    assert not pushable(step(0, 2, hypo_ids=[1, 0]), state)
    state.route[0].state.broken = True
    assert not pushable(step(0, 2), state)  # a lost span is rebuilt first
    state.route[0].state.broken = False
    assert not pushable(step(0, 2), session((0, 6)))  # one server: nothing to push to
    gap = session((0, 2), (3, 6))
    assert not pushable(step(0, 2), gap)  # a gap: the client relays
    short = session((0, 2), (2, 6))
    short.splice(1, 1, [link(2, 5)])
    assert not pushable(step(0, 2), short)  # short of the session's last block
    with_prompts = SpanTensors(torch.zeros(2, 2, 1), prompts=torch.zeros(6, 1, 1))
    assert not pushable(with_prompts, state)  # deep prompts are cut per span by the client
    state.route[1].state.ran(step(0, 2), 0)
    assert not pushable(step(0, 2), state)  # a span still holds an uncommitted step
    assert not pushable(step(0, 2), session((0, 2), (2, 6), push=False))


def test_the_route_changes_by_splices_that_hand_back_what_they_took_out() -> None:
    state = session((0, 2), (2, 4), (4, 6))
    first, middle, last = state.route
    replacements = [link(2, 3, "new-a"), link(3, 4, "new-b")]
    assert state.splice(1, 1, replacements) == [middle]
    assert [hop.span.peer_id for hop in state.route] == ["peer0:2", "new-a", "new-b", "peer4:6"]
    assert state.covers()
    with pytest.raises(IndexError, match="cannot replace hops 3:5 of a route of 4"):
        state.splice(3, 2, [])
    assert state.splice(0, len(state.route), []) == [first, *replacements, last] and state.route == []
