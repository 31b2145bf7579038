"""Routing modes on a real swarm: a server of all blocks announcing a low throughput, and two servers of its halves
announcing four times as much (rated_server.py). With routing "auto", a forward takes the fast halves (most
throughput: a full request's compute outweighs a hop) and an inference session the single server (least latency:
one round trip per token instead of two); "throughput" and "latency" send both kinds of work one way. Results equal
a local run whichever route they took."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.tools.local_swarm import LocalServer, LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference

RATED_SCRIPT = Path(__file__).with_name("rated_server.py")
NUM_BLOCKS = 5
# announced tokens/s per block: the whole server's, and the halves' (as unmeasured servers, capped at twice the median)
SLOW, FAST = 4000.0, 16000.0
# routes decided by the policy alone: no spot checks (they call other servers) and no exploration
OPTIONS = dict(explore_interval_s=0, verify_probability=0.0, verify_first_requests=0)
Route = list[tuple[str, int, int]]


def add_rated(swarm: LocalSwarm, start: int, end: int, throughput: float) -> LocalServer:
    """A server process for blocks start:end announcing `throughput`, joining `swarm` (not waited for)."""
    args = [
        sys.executable, str(RATED_SCRIPT), str(throughput), "serve", str(swarm.model), "--blocks", f"{start}:{end}",
        "--host", "127.0.0.1", "--initial-peers", *swarm.initial_peers, "--num-threads", "1",
    ]  # fmt: skip
    return swarm.add_command(
        args, start, end, f"rated-{len(swarm.servers)}-{start}-{end}.log", wait=False
    )  # stopped with the swarm


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    with LocalSwarm(str(tiny_model_dir)) as swarm:
        servers = [add_rated(swarm, 0, NUM_BLOCKS, SLOW), add_rated(swarm, 0, 2, FAST), add_rated(swarm, 2, 5, FAST)]
        swarm.wait_ready(servers)
        yield swarm


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir)


def routes(swarm: LocalSwarm) -> dict[str, Route]:
    whole, first, second = (str(server.peer_id) for server in swarm.servers)
    return {"whole": [(whole, 0, NUM_BLOCKS)], "halves": [(first, 0, 2), (second, 2, NUM_BLOCKS)]}


def forward_route(model_dir: Path, swarm: LocalSwarm, reference: torch.nn.Module, routing: str) -> Route:
    """The route a fresh client's forward took; its logits equal the local model's."""
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = reference(ids).logits
    with connected_model(model_dir, swarm, routing=routing, **OPTIONS) as model:
        logits = model(ids).logits
        calls = model.last_trace.calls
    assert (logits - expected).abs().max().item() <= LOGITS_ATOL
    return [(call.peer_id, call.start, call.end) for call in calls if call.kind == "forward"]


def session_route(model_dir: Path, swarm: LocalSwarm, reference: torch.nn.Module, routing: str) -> Route:
    """The route of a fresh client's inference session; its greedy generation equals the local model's."""
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected = reference.generate(ids, max_new_tokens=6, do_sample=False)
    with connected_model(model_dir, swarm, routing=routing, **OPTIONS) as model:
        with model.inference_session(max_length=16) as session:
            output = model.generate(ids, max_new_tokens=6, do_sample=False, session=session)
            route = [(span.peer_id, span.start, span.end) for span in session.route]
    assert output.tolist() == expected.tolist()
    return route


# Each route comes from a fresh client: measured servers (those a client called) win over ones it only pinged, so a
# client's later routes also depend on which servers it called first; a first route depends on the policy alone.
@pytest.mark.parametrize(
    "routing, forward, session",
    [("auto", "halves", "whole"), ("throughput", "halves", "halves"), ("latency", "whole", "whole")],
)
def test_forwards_and_sessions_follow_their_routing_policy(
    tiny_model_dir: Path, swarm: LocalSwarm, reference: torch.nn.Module, routing: str, forward: str, session: str
) -> None:
    expected = routes(swarm)
    assert forward_route(tiny_model_dir, swarm, reference, routing) == expected[forward]
    assert session_route(tiny_model_dir, swarm, reference, routing) == expected[session]
