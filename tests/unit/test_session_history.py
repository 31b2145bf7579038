"""Cutting a session's step history at a rollback: whole steps, a step's head, and the reorders after the cut."""

from __future__ import annotations

import torch

from swarmlm.client.session_state import cut_history, merge_history
from swarmlm.protocol.bundle import SpanTensors


def step(begin: int, seq: int, hypo_ids: list[int] | None = None) -> SpanTensors:
    batch = 2
    hidden = torch.arange(begin, begin + seq, dtype=torch.float32).expand(batch, seq)[..., None]  # (2, seq, 1)
    return SpanTensors(
        hidden,
        attention_mask=torch.ones(batch, begin + seq, dtype=torch.int64),
        position_ids=torch.arange(begin, begin + seq).expand(batch, seq),
        hypo_ids=None if hypo_ids is None else torch.tensor(hypo_ids),
    )


HISTORY = [step(0, 4), step(4, 1, [1, 0]), step(5, 3), step(8, 1, [0, 0])]


def test_a_cut_between_steps_keeps_the_steps_before_and_the_reorders_after() -> None:
    kept = cut_history(HISTORY, 5)
    assert kept[:2] == HISTORY[:2]
    # the last step's reorder is still in the servers' cache rows after the cut: it stays, without tokens
    assert len(kept) == 3 and kept[2].hidden.shape == (2, 0, 1) and kept[2].hypo_ids.tolist() == [0, 0]
    assert kept[2].attention_mask is None and kept[2].position_ids is None


def test_a_cut_inside_a_step_keeps_its_head_with_mask_and_positions() -> None:
    kept = cut_history(HISTORY, 6)
    head = kept[2]
    assert head.hidden[0, :, 0].tolist() == [5.0]
    assert head.attention_mask.shape == (2, 6) and head.position_ids.tolist() == [[5], [5]]
    assert sum(s.hidden.shape[1] for s in kept) == 6


def test_a_cut_to_nothing_or_everything() -> None:
    assert cut_history(HISTORY, 0) == []
    assert cut_history(HISTORY, 9) == HISTORY


def test_a_replay_joins_steps_between_reorders() -> None:
    history = [step(0, 4), step(4, 1), step(5, 1), step(6, 1, [1, 0]), step(7, 2), SpanTensors(torch.zeros(2, 0, 1))]
    merged = merge_history(history, max_tokens=1024)
    assert [s.hidden.shape[1] for s in merged] == [6, 3, 0]
    assert merged[0].hidden[0, :, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert merged[0].position_ids.tolist() == [list(range(6))] * 2 and merged[0].attention_mask.shape == (2, 6)
    assert merged[1].hypo_ids.tolist() == [1, 0] and merged[1].position_ids.tolist() == [[6, 7, 8]] * 2
    # at most 10 tokens (5 per row of 2): a joined step stops before it would exceed them
    assert [s.hidden.shape[1] for s in merge_history(history, max_tokens=10)] == [5, 1, 3, 0]
    assert merge_history([], 10) == []
