"""Server-to-server push through a real 3-server swarm: same tokens as local greedy, steps pushed, and failures
(a dead next hop, a killed server) fall back to the client-relayed path without changing the output."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.client.span_call import call_span
from swarmlm.errors import BadRequestError
from swarmlm.protocol.messages import PushStep
from swarmlm.server.push import TRUSTED_LINK_S
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import connected_model, load_reference, running_swarm

SPANS = [(0, 2), (2, 4), (4, 5), (0, 5)]  # three servers in a chain, and one holding every block (the replica)


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(tiny_model_dir, SPANS[:3]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir)


def local_greedy(reference: torch.nn.Module, ids: torch.Tensor, new: int) -> list[int]:
    with torch.inference_mode():
        out = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    return out[0].tolist()


def pushes(model: torch.nn.Module) -> int:
    return sum(info.pushes_received for info in model.server_infos().values())


def test_pushed_steps_give_the_local_greedy_tokens(tiny_model_dir, swarm, reference) -> None:
    ids = torch.tensor([[5, 17, 99, 3, 42, 8]])
    with connected_model(tiny_model_dir, swarm) as model:
        before = pushes(model)
        output = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        # every step after the first reached servers 2 and 3 from the server before them, not from the client
        assert pushes(model) - before >= 2 * 12
    assert output[0].tolist() == local_greedy(reference, ids, 12)


def test_relayed_and_pushed_outputs_are_identical(tiny_model_dir, swarm) -> None:
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    outputs = []
    for use_push in (False, True):
        with connected_model(tiny_model_dir, swarm, use_push=use_push) as model:
            with model.inference_session(max_length=32) as session:
                outputs.append(session.step(model.model.embed_tokens(ids)))
                for token in range(10, 16):
                    outputs.append(session.step(model.model.embed_tokens(torch.tensor([[token]]))))
    half = len(outputs) // 2
    for relayed, pushed in zip(outputs[:half], outputs[half:], strict=True):
        assert torch.equal(relayed, pushed)


def test_speculative_rollbacks_travel_with_pushed_steps(tiny_model_dir, swarm, reference) -> None:
    ids = torch.tensor([[7, 8, 9, 7, 8, 9, 7, 8]])
    with connected_model(tiny_model_dir, swarm) as model:
        output = model.generate(ids, max_new_tokens=16, prompt_lookup_num_tokens=4, eos_token_id=None)
    assert output[0].tolist() == local_greedy(reference, ids, 16)


def test_a_killed_server_mid_generation_falls_back_and_changes_nothing(tiny_model_dir, reference) -> None:
    ids = torch.tensor([[11, 12, 13, 14]])
    expected = local_greedy(reference, ids, 12)
    with running_swarm(tiny_model_dir, SPANS) as swarm, connected_model(tiny_model_dir, swarm) as model:
        middle = next(s for s in swarm.servers if (s.start, s.end) == (2, 4))
        with model.inference_session(max_length=32) as session:
            first = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, session=session)
            os.kill(middle.process.pid, signal.SIGKILL)
            middle.process.wait()
            rest = model.generate(None, max_new_tokens=8, min_new_tokens=8, do_sample=False, session=session)
    assert torch.cat([first, rest], dim=1)[0].tolist() == expected


def test_a_frozen_next_server_is_blamed_and_passed_by_within_the_liveness_window(tiny_model_dir, reference) -> None:
    """A server goes silent (SIGSTOP: connected, and mute) while the server before it waits to push it a step. The
    client, which waits for the first server's reply, pings the servers the step goes on to as well: it blames the
    silent one (not the healthy server waiting for it), re-routes around it in seconds, not after its request
    timeout, and the tokens do not change."""
    ids = torch.tensor([[21, 22, 23, 24]])
    expected = local_greedy(reference, ids, 12)
    spans = [*SPANS[:3], (2, 4)]  # a chain of three, and a replica of its middle
    with (
        running_swarm(tiny_model_dir, spans) as swarm,
        connected_model(tiny_model_dir, swarm, request_timeout_s=120.0, liveness_check_s=2.0) as model,
    ):
        manager = model.model.layers.client.manager
        with model.inference_session(max_length=32) as session:
            first = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, session=session)
            route = {span.start: span.peer_id for span in session.route}
            middle = next(s for s in swarm.servers if s.peer_id == route[2])
            middle.process.send_signal(signal.SIGSTOP)
            time.sleep(TRUSTED_LINK_S + 1)  # the first server now waits for the next one's word before it answers
            try:
                began = time.monotonic()
                rest = model.generate(None, max_new_tokens=8, min_new_tokens=8, do_sample=False, session=session)
                waited = time.monotonic() - began
                banned = manager.health.banned()
            finally:
                middle.process.send_signal(signal.SIGCONT)
    assert torch.cat([first, rest], dim=1)[0].tolist() == expected
    assert route[2] in banned and route[0] not in banned
    assert waited < 30.0, f"the client waited {waited:.0f} s: it did not notice the silent server by its pings"


def test_a_push_to_a_session_that_does_not_exist_is_refused(tiny_model_dir, swarm) -> None:
    step = PushStep(session_id="0" * 32, start_from_position=0)
    with connected_model(tiny_model_dir, swarm) as model:
        client = model.model.layers.client
        peer = next(iter(model.server_infos()))
        with pytest.raises(BadRequestError, match="no open session has this id"):
            client.loop.run(call_span(client.manager, peer, "rpc_push", step, [torch.zeros(1, 1, 64)], {}))
        # the server goes on serving
        assert model.generate(torch.tensor([[1, 2]]), max_new_tokens=2).shape == (1, 4)
