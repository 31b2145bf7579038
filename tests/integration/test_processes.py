"""Every process swarmlm starts dies with its parent: on SIGTERM in order, on SIGKILL of the parent regardless."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from swarmlm.tools import prefork as preforking
from tests.conftest import connected_model, running_swarm

# a user's script: a local swarm and a connected client, then it hangs until killed
USER_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import psutil, torch
    from swarmlm.client.model import AutoDistributedModelForCausalLM
    from swarmlm.tools.local_swarm import LocalSwarm

    swarm = LocalSwarm(sys.argv[1], threads_per_server=1)
    swarm.start_servers([(0, 5)])
    model = AutoDistributedModelForCausalLM.from_pretrained(sys.argv[1], initial_peers=swarm.initial_peers)
    model(torch.zeros(1, 3, dtype=torch.int64))
    pids = [p.pid for p in psutil.Process(os.getpid()).children(recursive=True)]
    print(json.dumps(pids), flush=True)
    time.sleep(600)
    """
)


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        time.sleep(0.2)
    return alive


@pytest.mark.parametrize("prefork", ["0", "1"], ids=["spawned", "forked"])
def test_sigkill_of_the_parent_takes_every_child_down(tiny_model_dir: Path, prefork: str) -> None:
    # servers spawned as users' swarms start them, and forked as the test suite's do (tools/prefork.py)
    parent = subprocess.Popen(
        [sys.executable, "-c", USER_SCRIPT, str(tiny_model_dir)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, preforking.ENV_SWITCH: prefork},
    )  # fmt: skip
    try:
        pids = json.loads(parent.stdout.readline())
        names = {psutil.Process(pid).name() for pid in pids}
        # the client's DHT process, the swarm's bootstrap DHT, a server and its DHT process, and their p2pds
        assert "p2pd" in names and len(pids) >= 6, names
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_gone(pids, timeout_s=15) == []
    finally:
        parent.kill()


def test_sigterm_stops_a_server_cleanly_and_it_leaves_the_swarm(tiny_model_dir: Path) -> None:
    with running_swarm(tiny_model_dir, [(0, 5), (0, 5)]) as swarm:
        leaving = swarm.servers[0]
        children = [p.pid for p in psutil.Process(leaving.process.pid).children(recursive=True)]
        assert children, "a server runs a DHT process with its p2pd"
        with connected_model(tiny_model_dir, swarm) as model:
            manager = model.model.layers.client.manager
            assert leaving.peer_id in manager.servers
            swarm.stop_server(leaving)
            assert leaving.process.returncode == 0
            assert wait_gone(children, timeout_s=10) == []
            model.model.layers.client.loop.run(manager.refresh())
            assert leaving.peer_id not in manager.servers  # it announced itself offline on the way out
            model(torch.zeros(1, 3, dtype=torch.int64))  # and the rest of the swarm still serves
