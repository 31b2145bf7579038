"""Generation's own record of a session's tokens: cut with the session at a rollback, and only on a model's session."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from swarmlm.client.generation import GenerationSession, generating, new_tokens
from swarmlm.client.inference import InferenceSession

MANAGER: Any = SimpleNamespace(config=SimpleNamespace(use_push=True))  # all a session reads before its first step
LOOP: Any = None  # no step runs here


def test_a_rollback_cuts_the_token_ids_and_the_last_output_after_the_prompt_prefix() -> None:
    session = GenerationSession(MANAGER, LOOP, 0, 4, max_length=16, prefix_tokens=2)
    session.state.position = 8  # as after a forward of 6 tokens behind a 2-token prompt prefix
    session.token_ids = torch.arange(6)[None]
    session.output_ids, session.output_mask = torch.arange(7)[None], torch.ones(1, 7)
    session.position = 5
    assert session.token_ids.tolist() == [[0, 1, 2]] and session.output_ids.tolist() == [[0, 1, 2]]
    assert session.output_mask.shape == (1, 3)
    new, hypo_ids, seen = new_tokens(session, torch.tensor([[0, 1, 2, 9, 9]]))  # only the tokens after the cut
    assert new.tolist() == [[9, 9]] and hypo_ids is None and seen == 3
    session.position = 1  # into the prefix: no token is left
    assert session.token_ids.shape == (1, 0) and session.output_ids.shape == (1, 0)


def test_generation_refuses_a_session_of_blocks_alone() -> None:
    blocks = InferenceSession(MANAGER, LOOP, 2, 5, max_length=8)
    with pytest.raises(TypeError, match="not one of blocks 2:5 alone"):
        generating(blocks)
    model_session = GenerationSession(MANAGER, LOOP, 0, 5, max_length=8)
    assert generating(model_session) is model_session
