"""A full swarm says so: with every session slot held, a new user is refused quickly and clearly (SwarmBusyError with
when to come back, after the client's busy_wait_s), the admitted users are neither slowed out nor pushed out and
finish with the local greedy output, and once a slot is free the refused user is served. Rates and their match with
the simulator are bench/overload.py's."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.errors import SwarmBusyError
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import connected_model, load_reference, one_thread, running_swarm

NUM_BLOCKS = 5
# two servers of the whole model with one session slot each: two users fill the swarm, a third is refused. One
# client (one peer of one host) holds them all: the per-peer and per-host shares are lifted so the slots bind, and
# the servers answer busy at once instead of waiting for room (--alloc-timeout 0)
SERVER_ARGS = ["--max-sessions", "1", "--max-sessions-per-peer", "8", "--host-share", "1", "--peer-cache-share", "1",
               "--alloc-timeout", "0"]  # fmt: skip
BUSY_WAIT_S = 2.0  # the client's busy_wait_s: how long the refused user keeps trying
# the refusal comes within busy_wait_s and a few polls of the swarm (generous on a loaded 2-core machine) ...
REFUSED_WITHIN_S = BUSY_WAIT_S + 8.0
# ... not after max_retries busy answers: with this many, a wait restarted at each cool-down would take ~30 s
MAX_RETRIES = 30
PROMPTS = [torch.tensor([[5, 17, 42, 9]]), torch.tensor([[3, 3, 81]]), torch.tensor([[100, 2]])]
NEW_TOKENS = 6
MAX_LENGTH = 16
USER_DEADLINE_S = 60.0
# greedy, and exactly the tokens asked: no end-of-sequence (the tiny model has no pad token: none is padded anyway)
GREEDY = {"do_sample": False, "eos_token_id": [], "pad_token_id": 0}


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(tiny_model_dir, [(0, NUM_BLOCKS), (0, NUM_BLOCKS)], extra_args=SERVER_ARGS) as swarm:
        yield swarm


def greedy(model: torch.nn.Module, ids: torch.Tensor) -> list[int]:
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, **GREEDY)
    return out[0, ids.shape[1] :].tolist()


def hold_slot(model: torch.nn.Module, ids: torch.Tensor, opened: threading.Event, release: threading.Event,
              outputs: list[list[int]]) -> None:  # fmt: skip
    """A user who generates in a session and keeps it open (its slot held) until `release`, then generates more."""
    with model.inference_session(max_length=MAX_LENGTH) as session:
        first = model.generate(ids, max_new_tokens=NEW_TOKENS // 2, session=session, **GREEDY)
        opened.set()
        release.wait(USER_DEADLINE_S)
        rest = model.generate(None, max_new_tokens=NEW_TOKENS - NEW_TOKENS // 2, session=session, **GREEDY)
    outputs.append(first[0, ids.shape[1] :].tolist() + rest[0].tolist())


def test_a_full_swarm_refuses_quickly_with_a_retry_hint_and_admitted_users_finish_exactly(
    swarm: LocalSwarm, tiny_model_dir: Path
) -> None:
    with one_thread():
        reference = load_reference(tiny_model_dir)
        expected = [greedy(reference, ids) for ids in PROMPTS]
    with connected_model(tiny_model_dir, swarm, busy_wait_s=BUSY_WAIT_S, max_retries=MAX_RETRIES) as model:
        release, holders, outputs = threading.Event(), [], []
        for ids in PROMPTS[:2]:  # two users take the two slots (the second routes around the first's server)
            opened = threading.Event()
            holder = threading.Thread(target=hold_slot, args=(model, ids, opened, release, outputs), daemon=True)
            holder.start()
            holders.append(holder)
            assert opened.wait(USER_DEADLINE_S), "an admitted user did not get its first tokens"
        began = time.monotonic()
        with pytest.raises(SwarmBusyError, match=r"The swarm is full.*Try again in \d+ s") as refused:
            greedy(model, PROMPTS[2])
        waited_s = time.monotonic() - began
        assert BUSY_WAIT_S <= waited_s < REFUSED_WITHIN_S, waited_s
        assert 0 < refused.value.retry_after_s <= BUSY_WAIT_S  # the servers' hint, bounded by the client's wait
        release.set()
        for holder in holders:
            holder.join(USER_DEADLINE_S)
            assert not holder.is_alive(), "an admitted user did not finish"
        assert sorted(outputs) == sorted(expected[:2])  # the admitted users were neither pushed out nor disturbed
        assert greedy(model, PROMPTS[2]) == expected[2]  # room again: the refused user is served
