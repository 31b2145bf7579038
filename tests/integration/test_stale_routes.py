"""A client whose view of the swarm is out of date: a server restarted (same identity, same address) with other
blocks refuses a request for the blocks it no longer serves at once, with an error that says what it serves, and the
client re-reads the swarm and re-routes, instead of waiting for a timeout or calling its own request bad."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.client.span_call import Expected, RerouteError, call_span
from swarmlm.errors import MissingAdapterError
from swarmlm.protocol.messages import ForwardRequest
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference
from tests.tiny_families import build_adapter

# a refused request and its re-route take well under this on a loaded machine; a timeout would take 60 s
REROUTE_DEADLINE_S = 15.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_server_that_moved_refuses_its_old_blocks_and_the_client_reroutes(tiny_model_dir: Path, tmp_path: Path):
    inputs = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = load_reference(tiny_model_dir)(inputs).logits
    same_node = ["--identity", str(tmp_path / "moving.key"), "--port", str(free_port())]
    swarm = LocalSwarm(str(tiny_model_dir), threads_per_server=1)
    try:
        moving = swarm.add_server(0, 3, wait=False, extra_args=same_node)
        swarm.wait_ready([moving, swarm.add_server(3, 5, wait=False)])
        # the client reads the swarm once: its view stays as it is now for the whole test
        options = dict(swarm_refresh_interval_s=3600.0, missing_blocks_timeout_s=60.0, request_timeout_s=60.0)
        with connected_model(tiny_model_dir, swarm, **options) as model:
            with torch.inference_mode():
                assert (model(inputs).logits - expected).abs().max().item() <= LOGITS_ATOL
            swarm.stop_server(moving)
            # the same peer at the same address now serves 3:5; blocks 0:3 moved to a new server
            swarm.wait_ready([swarm.add_server(3, 5, wait=False, extra_args=same_node), swarm.add_server(0, 3)])
            assert swarm.servers[2].peer_id == moving.peer_id
            began = time.monotonic()
            with torch.inference_mode():
                logits = model(inputs).logits
            elapsed_s = time.monotonic() - began
            trace = model.last_trace
        assert (logits - expected).abs().max().item() <= LOGITS_ATOL
        assert elapsed_s < REROUTE_DEADLINE_S, f"re-routing took {elapsed_s:.1f} s"
        assert trace.retries == 1 and swarm.servers[3].peer_id in trace.servers
    finally:
        swarm.close()


def test_a_server_that_dropped_the_adapter_refuses_it_and_the_client_says_none_holds_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapter = build_adapter(tiny_model_dir, tmp_path / "tuned", seed=1)
    same_node = ["--identity", str(tmp_path / "node.key"), "--port", str(free_port())]
    swarm = LocalSwarm(str(tiny_model_dir), threads_per_server=1)
    try:
        node = swarm.add_server(0, 5, extra_args=[*same_node, "--adapters", str(adapter)])
        options = dict(active_adapter="tuned", swarm_refresh_interval_s=3600.0, missing_blocks_timeout_s=60.0)
        inputs = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
        with connected_model(tiny_model_dir, swarm, **options) as model:
            with torch.inference_mode():
                model(inputs)
            swarm.stop_server(node)
            swarm.add_server(0, 5, extra_args=same_node)  # the same peer, without the adapter now
            began = time.monotonic()
            with pytest.raises(MissingAdapterError) as refused, torch.inference_mode():
                model(inputs)
            elapsed_s = time.monotonic() - began
        assert elapsed_s < REROUTE_DEADLINE_S, f"the error took {elapsed_s:.1f} s"
        assert f"adapter 'tuned' for block(s) 0-4; the servers of those blocks hold: ...{node.peer_id[-6:]} " in str(
            refused.value
        )
        assert "(blocks 0:5): no adapters" in str(refused.value)
    finally:
        swarm.close()


@pytest.fixture(scope="module")
def lone_server(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    """One server of blocks 3:5 of the 5."""
    swarm = LocalSwarm(str(tiny_model_dir), threads_per_server=1)
    try:
        swarm.add_server(3, 5)
        yield swarm
    finally:
        swarm.close()


@pytest.mark.parametrize("blocks", [(0, 3), (3, 9)], ids=["blocks-it-does-not-serve", "blocks-beyond-the-model"])
def test_blocks_a_server_does_not_serve_are_refused_at_once(
    tiny_model_dir: Path, lone_server: LocalSwarm, blocks: tuple[int, int]
) -> None:
    peer_id = lone_server.servers[0].peer_id
    header = ForwardRequest(start_block=blocks[0], end_block=blocks[1], tensors=["hidden"])
    hidden = torch.zeros(1, 2, 64)
    with connected_model(tiny_model_dir, lone_server, request_timeout_s=60.0) as model:
        client = model.model.layers.client
        began = time.monotonic()
        with pytest.raises(RerouteError) as refused:
            expected = {"hidden": Expected.like(hidden)}
            call = call_span(client.manager, peer_id, "rpc_forward", header, [hidden], expected)
            client.loop.run(call)
        assert time.monotonic() - began < 5.0
    assert refused.value.kind == "not_served"
    assert f"blocks {blocks[0]}:{blocks[1]} are not served here: this server serves 3:5" in str(refused.value)
