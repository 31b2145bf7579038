"""The client among bad and overloaded servers: a real swarm with a real hostile server process (hostile_server.py)
that lies, refuses or hangs; results must still equal a local run, or fail clearly and within bounded time."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.errors import BadRequestError, RemoteCallError
from swarmlm.tools.local_swarm import LocalServer, LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm
from tests.integration.hostile_server import CANCELLED_LINE, HUGE_REPLY_BYTES, SERVED_LINE

HOSTILE_SCRIPT = Path(__file__).with_name("hostile_server.py")
# a refused or failed request must reach the user well within this (no request timeout is waited out)
PROMPT_S = 10.0
# the client's peak memory may grow by at most this while a server streams HUGE_REPLY_BYTES at it
MEMORY_SLACK_BYTES = 128 << 20


def add_hostile(swarm: LocalSwarm, start: int, end: int, mode_file: Path) -> LocalServer:
    """A hostile server process joining `swarm` like LocalSwarm.add_server would, its behaviour read from mode_file."""
    args = [
        sys.executable, str(HOSTILE_SCRIPT), str(mode_file), "serve", str(swarm.model),
        "--blocks", f"{start}:{end}", "--host", "127.0.0.1", "--initial-peers", *swarm.initial_peers,
        "--num-threads", "1",
    ]  # fmt: skip
    if swarm.dht_prefix:
        args += ["--dht-prefix", swarm.dht_prefix]
    return swarm.add_command(args, start, end, f"hostile-{start}-{end}.log")  # stopped with the swarm


class Hostile:
    def __init__(self, server: LocalServer, mode_file: Path):
        self.server, self.mode_file = server, mode_file
        self.peer_id: str = server.peer_id

    def set(self, mode: str) -> None:
        self.mode_file.write_text(mode)

    def count(self, line: str) -> int:
        return self.server.log_path.read_text(errors="replace").count(line)

    def wait_for(self, line: str, count: int, timeout_s: float = PROMPT_S) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.count(line) < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir)


@pytest.fixture(scope="module")
def mixed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSwarm, Hostile]]:
    """Honest servers for 0:2 and 2:5, and a hostile one for 0:5 that a fresh client tries first (one hop, fast)."""
    mode_file = tmp_path_factory.mktemp("hostile") / "mode"
    mode_file.write_text("honest")
    with running_swarm(tiny_model_dir, [(0, 2), (2, 5)]) as swarm:
        yield swarm, Hostile(add_hostile(swarm, 0, 5, mode_file), mode_file)


@pytest.fixture(scope="module")
def alone(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSwarm, Hostile]]:
    """A swarm whose only server is hostile."""
    mode_file = tmp_path_factory.mktemp("hostile-alone") / "mode"
    mode_file.write_text("honest")
    with running_swarm(tiny_model_dir, []) as swarm:
        yield swarm, Hostile(add_hostile(swarm, 0, 5, mode_file), mode_file)


def manager_of(model: torch.nn.Module):
    return model.model.layers.client.manager


def failures_of(model: torch.nn.Module, peer_id: str) -> int:
    return manager_of(model).health._bans.get(peer_id, (0.0, 0))[1]


IDS = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(1))


def assert_equals_local(model: torch.nn.Module, reference: torch.nn.Module, ids: torch.Tensor = IDS) -> None:
    with torch.inference_mode():
        expected = reference(ids).logits
    assert (model(ids).logits - expected).abs().max().item() <= LOGITS_ATOL


@pytest.mark.parametrize("mode", ["nan", "wrong_shape", "wrong_dtype"])
def test_bad_replies_are_the_servers_failure(tiny_model_dir: Path, reference, mixed, mode: str) -> None:
    swarm, hostile = mixed
    hostile.set(mode)
    with connected_model(tiny_model_dir, swarm) as model:
        assert_equals_local(model, reference)
        assert failures_of(model, hostile.peer_id) == 1  # tried first, failed once, banned


def test_huge_reply_is_cut_off_without_buffering_it(tiny_model_dir: Path, reference, mixed) -> None:
    swarm, hostile = mixed
    hostile.set("huge")
    with connected_model(tiny_model_dir, swarm) as model:
        peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        began = time.monotonic()
        assert_equals_local(model, reference)
        assert time.monotonic() - began < PROMPT_S
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
        assert grown < min(MEMORY_SLACK_BYTES, HUGE_REPLY_BYTES // 4)
        assert failures_of(model, hostile.peer_id) == 1


def test_one_servers_bad_request_goes_to_another_server(tiny_model_dir: Path, reference, mixed) -> None:
    swarm, hostile = mixed
    hostile.set("bad_request")
    with connected_model(tiny_model_dir, swarm) as model:
        assert_equals_local(model, reference)
        assert failures_of(model, hostile.peer_id) == 0  # avoided for that request only, not banned
        # a request that is really bad is refused by two servers and reaches the user at once
        for mode in ("bad_request", "honest"):
            hostile.set(mode)
            began = time.monotonic()
            with pytest.raises(BadRequestError, match="hidden" if mode == "honest" else None):
                model.model.layers(torch.randn(1, 3, 32))
            assert time.monotonic() - began < PROMPT_S


@pytest.mark.parametrize("mode", ["busy", "too_large"])
def test_busy_or_too_large_server_is_routed_around_not_banned(
    tiny_model_dir: Path, reference, mixed, mode: str
) -> None:
    swarm, hostile = mixed
    hostile.set(mode)
    with connected_model(tiny_model_dir, swarm) as model:
        assert_equals_local(model, reference)
        manager = manager_of(model)
        assert failures_of(model, hostile.peer_id) == 0
        time.sleep(manager.config.ban_base_s)  # a busy server cools down this long at most
        assert hostile.peer_id not in manager.health.banned()
        # once it has room, the same client uses it again (it answered, so it is known to be near)
        hostile.set("honest")
        served = hostile.count(SERVED_LINE)
        assert_equals_local(model, reference)
        assert hostile.wait_for(SERVED_LINE, served + 1)


def test_a_failing_sub_batch_cancels_its_siblings(tiny_model_dir: Path, mixed) -> None:
    swarm, hostile = mixed
    hostile.set("hang_2rows")  # the sub-batch of 2 rows hangs, the one of 1 row fails
    cancelled = hostile.count(CANCELLED_LINE)
    with connected_model(tiny_model_dir, swarm, max_retries=0, max_tokens_per_request=8) as model:
        began = time.monotonic()
        with pytest.raises(RemoteCallError, match="giving up"):
            model.model.layers(torch.randn(3, 4, 64))
        assert time.monotonic() - began < PROMPT_S
        # the hanging sibling's stream was closed: the server saw the client give up on it
        assert hostile.wait_for(CANCELLED_LINE, cancelled + 1)


@pytest.mark.parametrize("mode", ["server", "nan", "busy"])
def test_only_misbehaving_servers_give_a_clear_error_in_bounded_time(tiny_model_dir: Path, alone, mode: str) -> None:
    swarm, hostile = alone
    hostile.set(mode)
    with connected_model(tiny_model_dir, swarm, max_retries=3, ban_base_s=0.2) as model:
        began = time.monotonic()
        # only busy answers: the swarm is full, and the error says so (and when to come back)
        expected = r"The swarm is full: .* answered busy" if mode == "busy" else "giving up after 4 failed calls"
        with pytest.raises(RemoteCallError, match=expected):
            model.model.layers(torch.randn(1, 3, 64))
        assert time.monotonic() - began < 2 * PROMPT_S


def test_bad_request_from_the_only_server_is_raised_at_once(tiny_model_dir: Path, alone) -> None:
    swarm, hostile = alone
    hostile.set("bad_request")
    with connected_model(tiny_model_dir, swarm) as model:
        began = time.monotonic()
        with pytest.raises(BadRequestError, match="hostile server says bad_request"):
            model.model.layers(torch.randn(1, 3, 64))
        assert time.monotonic() - began < PROMPT_S


def test_sub_batches_too_large_for_every_server_are_split(tiny_model_dir: Path, reference, alone) -> None:
    swarm, hostile = alone
    hostile.set("too_large_rows")  # only single rows are accepted
    with connected_model(tiny_model_dir, swarm) as model:
        assert_equals_local(model, reference)
        assert failures_of(model, hostile.peer_id) == 0


def local_blocks(reference: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(hidden.shape[1]).unsqueeze(0).expand(hidden.shape[0], -1)
    rotary = reference.model.rotary_emb(hidden, positions)
    for layer in reference.model.layers:
        hidden = layer(hidden, position_embeddings=rotary, position_ids=positions)
    return hidden


def test_backward_reply_with_nan_is_recomputed_elsewhere(tiny_model_dir: Path, reference, mixed) -> None:
    swarm, hostile = mixed
    generator = torch.Generator().manual_seed(2)
    hidden, weights = torch.randn(2, 5, 64, generator=generator), torch.randn(2, 5, 64, generator=generator)
    local = hidden.clone().requires_grad_()
    (local_blocks(reference, local) * weights).sum().backward()
    hostile.set("honest")  # the forward goes through the hostile server, its backward then lies
    with connected_model(tiny_model_dir, swarm) as model:
        remote = hidden.clone().requires_grad_()
        output = model.model.layers(remote)
        hostile.set("nan")
        (output * weights).sum().backward()
        assert failures_of(model, hostile.peer_id) == 1
    assert (remote.grad - local.grad).abs().max().item() <= 1e-5 * local.grad.abs().max().item() + 1e-7
