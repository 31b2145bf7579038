"""An inference step whose caller gave up (Ctrl-C, a timeout) while the server computed it: the server's reply still
arrives on the session's stream later. The next step must not read that stale reply as its own: the session
rebuilds the span (replaying its committed steps) and gives what a local run gives, without blaming the server."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from swarmlm.models.span import SpanModel
from swarmlm.protocol.bundle import SpanTensors
from tests.conftest import LOGITS_ATOL, connected_model, running_swarm
from tests.integration.test_inflight_failover import add_slow

# each step waits this long on the server before it computes: the window in which the caller gives up
DELAY_S = 1.5
NUM_BLOCKS = 5


def test_a_step_given_up_mid_flight_leaves_no_stale_reply_for_the_next(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    hidden, other = torch.randn(1, 4, 64), torch.randn(1, 2, 64)
    with torch.inference_mode():
        expected = SpanModel.from_dir(tiny_model_dir, 0, NUM_BLOCKS)(hidden)
    with running_swarm(tiny_model_dir, []) as swarm:
        add_slow(swarm, 0, NUM_BLOCKS, delay_s=DELAY_S)  # the only server: the rebuilt span opens on it again
        with connected_model(tiny_model_dir, swarm) as model:
            with model.model.layers.inference_session(max_length=16) as session:
                first = session.step(hidden[:, :2])
                # the caller gives up on a step of the same shape as the next one (its reply would pass for it)
                with pytest.raises(TimeoutError):
                    session.loop.run(session.astep(SpanTensors(other)), timeout=DELAY_S / 3)
                time.sleep(DELAY_S)  # the given-up step's reply reaches the stream meanwhile
                second = session.step(hidden[:, 2:4])
                # the server did nothing wrong: the span is rebuilt without a failure charged to it
                assert (session.last_trace.replays, session.last_trace.retries) == (1, 0)
                third = session.step(hidden[:, 2:4] * 0)  # position 4 now: the next step after the replay
                assert session.position == 6
    assert (first - expected[:, :2]).abs().max().item() <= LOGITS_ATOL
    assert (second - expected[:, 2:4]).abs().max().item() <= LOGITS_ATOL
    with torch.inference_mode():
        expected_third = SpanModel.from_dir(tiny_model_dir, 0, NUM_BLOCKS)(
            torch.cat([hidden, hidden[:, 2:4] * 0], dim=1)
        )[:, 4:]
    assert (third - expected_third).abs().max().item() <= LOGITS_ATOL
