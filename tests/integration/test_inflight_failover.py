"""Servers SIGKILLed while a request is in flight: the client notices the lost connection at once and re-routes,
instead of waiting out its request timeout. The dying server is a real, slow server process (slow_server.py) killed
after it has received a request and before it answers. A server that goes silent instead (SIGSTOP: a hung process
or a pulled cable, no connection closes) is noticed by the client's liveness pings within seconds."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.tools.local_swarm import LocalServer, LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm
from tests.integration.slow_server import BEGAN_LINE

SLOW_SCRIPT = Path(__file__).with_name("slow_server.py")
# the slow server holds each request this long before computing it: the window in which the test kills it
DELAY_S = 5.0
NUM_BLOCKS = 5
# the client's request timeout: far longer than any recovery may take
REQUEST_TIMEOUT_S = 60.0
# the whole call, kill and recovery included, must end well within this (generous for 2 shared cores)
RECOVERED_S = 20.0
# a silent server is pinged after the client's liveness_check_s (5 s) and fails after as long again; then recovery
SILENCE_RECOVERED_S = 35.0


def add_slow(swarm: LocalSwarm, start: int, end: int, delay_s: float = DELAY_S) -> LocalServer:
    """A slow server process for blocks start:end joining `swarm` like LocalSwarm.add_server would."""
    args = [
        sys.executable, str(SLOW_SCRIPT), str(delay_s), "serve", str(swarm.model), "--blocks", f"{start}:{end}",
        "--host", "127.0.0.1", "--initial-peers", *swarm.initial_peers, "--num-threads", "1",
    ]  # fmt: skip
    return swarm.add_command(
        args, start, end, f"slow-{len(swarm.servers)}-{start}-{end}.log"
    )  # stopped with the swarm


def began(server: LocalServer) -> int:
    return server.log_path.read_text(errors="replace").count(BEGAN_LINE)


def kill_when_busy(
    swarm: LocalSwarm, server: LocalServer, requests: int = 1, timeout_s: float = 30.0, silence: bool = False
) -> bool:
    """SIGKILL `server` (or with silence, SIGSTOP it: alive, connected, and mute) once it has received `requests`
    requests (the last one is then in flight)."""
    deadline = time.monotonic() + timeout_s
    while began(server) < requests:
        if time.monotonic() > deadline or server.process.poll() is not None:
            return False
        time.sleep(0.05)
    if silence:
        server.process.send_signal(signal.SIGSTOP)
    else:
        swarm.kill(server)
    return True


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    # honest servers for 0:2 and 2:5; each test adds a slow server for 0:5 that a fresh client tries first (one hop)
    with running_swarm(tiny_model_dir, [(0, 2), (2, 5)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir)


def timed_with_kill(
    swarm: LocalSwarm, slow: LocalServer, call: Callable[[], object], requests: int = 1, silence: bool = False
) -> float:
    """Run `call` while the slow server is killed (or silenced) with its `requests`-th request in flight; the call's
    seconds. A silenced server is killed afterwards."""
    killed: list[bool] = []
    killer = threading.Thread(target=lambda: killed.append(kill_when_busy(swarm, slow, requests, silence=silence)))
    killer.start()
    began_at = time.monotonic()
    try:
        call()
    finally:
        elapsed = time.monotonic() - began_at
        killer.join()
        if silence:
            swarm.kill(slow)
    assert killed == [True], f"the client never sent its request to the slow server:\n{slow.log_tail()}"
    return elapsed


@pytest.mark.parametrize("silence", [False, True], ids=["killed", "gone-silent"])
def test_generation_recovers_from_a_server_lost_during_a_step(tiny_model_dir: Path, swarm, reference, silence) -> None:
    slow = add_slow(swarm, 0, NUM_BLOCKS)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(5 + silence))
    with torch.inference_mode():
        expected = reference.generate(ids, max_new_tokens=8, do_sample=False)
    outputs = []
    with connected_model(tiny_model_dir, swarm, request_timeout_s=REQUEST_TIMEOUT_S) as model:
        generate = lambda: outputs.append(model.generate(ids, max_new_tokens=8, do_sample=False))  # noqa: E731
        elapsed = timed_with_kill(swarm, slow, generate, silence=silence)
        assert model.model.layers.client.manager.health.failed(slow.peer_id)
    assert outputs[0].tolist() == expected.tolist()
    assert elapsed < (SILENCE_RECOVERED_S if silence else RECOVERED_S), f"generation took {elapsed:.1f} s"


@pytest.mark.parametrize("silence", [False, True], ids=["killed", "gone-silent"])
def test_forward_recovers_from_a_server_lost_in_flight(tiny_model_dir: Path, swarm, reference, silence) -> None:
    slow = add_slow(swarm, 0, NUM_BLOCKS)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6 + 3 * silence))
    with torch.inference_mode():
        expected = reference(ids).logits
    logits = []
    with connected_model(tiny_model_dir, swarm, request_timeout_s=REQUEST_TIMEOUT_S) as model:
        elapsed = timed_with_kill(swarm, slow, lambda: logits.append(model(ids).logits), silence=silence)
    assert (logits[0] - expected).abs().max().item() <= LOGITS_ATOL
    assert elapsed < (SILENCE_RECOVERED_S if silence else RECOVERED_S), f"forward took {elapsed:.1f} s"


def test_backward_recovers_at_once_from_a_kill_in_flight(tiny_model_dir: Path, swarm, reference) -> None:
    slow = add_slow(swarm, 0, NUM_BLOCKS)
    generator = torch.Generator().manual_seed(7)
    hidden, weights = torch.randn(2, 5, 64, generator=generator), torch.randn(2, 5, 64, generator=generator)
    local = hidden.clone().requires_grad_()
    positions = torch.arange(5).unsqueeze(0).expand(2, -1)
    out, rotary = local, reference.model.rotary_emb(local, positions)
    for layer in reference.model.layers:
        out = layer(out, position_embeddings=rotary, position_ids=positions)
    (out * weights).sum().backward()
    with connected_model(tiny_model_dir, swarm, request_timeout_s=REQUEST_TIMEOUT_S) as model:
        remote = hidden.clone().requires_grad_()
        output = model.model.layers(remote)  # it ran on the slow server (its first request)
        elapsed = timed_with_kill(swarm, slow, lambda: (output * weights).sum().backward(), requests=2)
    assert (remote.grad - local.grad).abs().max().item() <= 1e-5 * local.grad.abs().max().item() + 1e-7
    assert elapsed < RECOVERED_S, f"backward took {elapsed:.1f} s"


def test_a_slow_server_that_answers_pings_is_waited_for(tiny_model_dir: Path, swarm, reference) -> None:
    # pinged every second while it holds the request for DELAY_S: busy, not gone, so it keeps the request
    slow = add_slow(swarm, 0, NUM_BLOCKS)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(10))
    with torch.inference_mode():
        expected = reference(ids).logits
    try:
        # no spot checks: they would re-run the request on the honest servers too
        with connected_model(tiny_model_dir, swarm, request_timeout_s=REQUEST_TIMEOUT_S, liveness_check_s=1.0,
                             verify_probability=0.0, verify_first_requests=0) as model:  # fmt: skip
            logits = model(ids).logits
            assert model.last_trace.servers == [slow.peer_id], "the slow server lost its request though it answered"
            assert model.last_trace.total_ms >= DELAY_S * 1000
            assert not model.model.layers.client.manager.health.failed(slow.peer_id)
        assert (logits - expected).abs().max().item() <= LOGITS_ATOL
    finally:
        swarm.kill(slow)
