"""Two clients, one server and two replicas: forwards spread over both replicas, each client keeps its own."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from swarmlm.tools.local_swarm import LocalServer
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm

# seeds whose first draw between two tied replicas picks the first (1) and the second (0) of them in sorted order:
# the first route of a client is a draw between replicas it has not measured yet, so these two clients take
# different replicas whichever peer ids the servers got
FIRST_PICKS_SECOND, FIRST_PICKS_FIRST = 0, 1
# spot checks off: a check would call the replica a client does not route through (the test counts those)
CHECKS_OFF = dict(verify_probability=0.0, verify_first_requests=0)
# routed for latency: the replicas then tie on their round trips; for throughput (a forward's default) they would
# differ by their start-up measurements of speed, taken on shared cores, by more than the tie tolerance
LATENCY = dict(routing="latency")


def _forwards_served(server: LocalServer, timeout_s: float = 5.0, at_least: int = 1) -> int:
    """How many forward requests the server's log shows (its output reaches the log asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = sum(" forward blocks=" in line for line in server.log_path.read_text(errors="replace").splitlines())
        if count >= at_least or time.monotonic() > deadline:
            return count
        time.sleep(0.1)


def test_two_clients_spread_over_replicas_and_each_keeps_its_own(tiny_model_dir: Path) -> None:
    reference = load_reference(tiny_model_dir)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected = reference(ids).logits
    with (
        running_swarm(tiny_model_dir, [(0, 2), (2, 5), (2, 5)]) as swarm,
        # no exploration: a client trying the other replica would break the stickiness measured here
        connected_model(tiny_model_dir, swarm, explore_interval_s=0, **CHECKS_OFF, **LATENCY) as first,
        connected_model(tiny_model_dir, swarm, explore_interval_s=0, **CHECKS_OFF, **LATENCY) as second,
    ):
        managers = [model.model.layers.client.manager for model in (first, second)]
        for manager, seed in zip(managers, (FIRST_PICKS_FIRST, FIRST_PICKS_SECOND), strict=True):
            manager._rng = random.Random(seed)  # the draw of the first route, made reproducible
        for _ in range(8):  # many short forwards, the two clients taking turns
            for model in (first, second):
                assert (model(ids).logits - expected).abs().max().item() <= LOGITS_ATOL
        head, *replicas = swarm.servers
        assert all(_forwards_served(replica) >= 1 for replica in replicas), "both replicas should have served"
        # stickiness: each client measured (so used) exactly one replica, and not the same one
        used = [{r.peer_id for r in replicas if manager.health.has_measured(r.peer_id)} for manager in managers]
        assert all(len(peers) == 1 for peers in used) and used[0] != used[1], used
        assert _forwards_served(head, at_least=16) == 16
