"""A restart must not split the swarm: real `swarmlm serve` and `swarmlm dht` processes are killed and started again
with the same command (same --identity and --port), and `swarmlm status`'s view of the swarm through every node is
whole again, exactly, within a deadline."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmlm.api.status import swarm_snapshot
from swarmlm.checks import check_can_listen
from swarmlm.errors import SwarmError
from swarmlm.swarm.dht import start_dht
from swarmlm.utils.processes import spawn_bound

SWARMLM = [sys.executable, "-m", "swarmlm.cli.main"]
PREFIX = "restarts"
# short intervals keep the test short; the defaults (15 s re-dial, 10 s announce) heal in about as long as theirs
RECONNECT = ["--reconnect-interval", "2"]
ANNOUNCE_S = 2.0
# a killed node stays down this long: longer than the others' announce interval, so their stores to it fail and
# hivemind drops it from their routing tables (a shorter absence goes unnoticed, and proves nothing)
DOWN_S = 2.5 * ANNOUNCE_S
START_TIMEOUT_S = 60.0  # a node prints its ready line within this (the machine is shared and slow)
HEAL_TIMEOUT_S = 45.0  # the swarm is whole again, through every node, within this of a restarted node's start
PORT_FREE_TIMEOUT_S = 10.0  # a killed node's p2pd dies within this (it watches its parent, utils/processes.py)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Node:
    """One `swarmlm` process that can be killed and started again with the very same command."""

    def __init__(self, name: str, args: list[str], ready: str, folder: Path):
        self.name, self.args, self.ready = name, args, ready
        self.log = folder / f"{name}.log"
        self.process: subprocess.Popen | None = None
        self.peers: list[str] = []  # the addresses others join with (the same after each start)

    def start(self) -> float:
        """Start and wait until ready; the seconds it took."""
        began = time.monotonic()
        offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            self.process = spawn_bound([*SWARMLM, *self.args], stdout=log, stderr=subprocess.STDOUT)
        while time.monotonic() - began < START_TIMEOUT_S:
            text = self.log.read_bytes()[offset:].decode(errors="replace")
            if self.ready in text:
                line = next(line for line in text.splitlines() if line.startswith("Others join with:"))
                self.peers = line.split("--initial-peers ", 1)[1].split()
                return time.monotonic() - began
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"{self.name} did not start:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL, as a crash or an operator's `kill -9` would; wait until its port is free for the restart."""
        if self.process is None:
            return
        self.process.kill()
        self.process.wait(10)
        port = int(self.args[self.args.index("--port") + 1])
        deadline = time.monotonic() + PORT_FREE_TIMEOUT_S
        while True:
            try:
                check_can_listen("127.0.0.1", port)
                return
            except SwarmError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def server(name: str, model: Path, blocks: str, folder: Path, *join: str) -> Node:
    args = ["serve", str(model), "--blocks", blocks, "--host", "127.0.0.1", "--port", str(free_port()),
            "--identity", str(folder / f"{name}.key"), "--dht-prefix", PREFIX, "--num-threads", "1",
            "--announce-interval", str(ANNOUNCE_S), *RECONNECT, *join]  # fmt: skip
    return Node(name, args, "Server ready: peer ", folder)


def dht_node(name: str, folder: Path) -> Node:
    args = ["dht", "--new-swarm", "--host", "127.0.0.1", "--port", str(free_port()),
            "--identity", str(folder / f"{name}.key"), *RECONNECT]  # fmt: skip
    return Node(name, args, "DHT ready", folder)


def online_spans(peers: list[str]) -> set[tuple[str, int, int]]:
    """What `swarmlm status` shows through `peers`: the servers online and answering, as (peer id, start, end)."""
    dht = start_dht(peers, host="127.0.0.1", client_mode=True, reconnect_interval_s=0)
    try:
        snapshot = swarm_snapshot(dht)
    finally:
        dht.shutdown()
    return {(row["peer_id"], row["start"], row["end"]) for model in snapshot["models"] for row in model["servers"]
            if model["dht_prefix"] == PREFIX and row["state"] == "online"}  # fmt: skip


def peer_id(node: Node) -> str:
    return node.peers[0].rsplit("/p2p/", 1)[1]


def wait_whole(nodes: list[Node], expected: set[tuple[str, int, int]], began: float) -> float:
    """Seconds from `began` until status through every node shows exactly `expected`."""
    seen: dict[str, set[tuple[str, int, int]]] = {}
    while time.monotonic() - began < HEAL_TIMEOUT_S:
        seen = {node.name: online_spans(node.peers) for node in nodes}
        if all(spans == expected for spans in seen.values()):
            return time.monotonic() - began
        time.sleep(0.5)
    raise AssertionError(f"still split {HEAL_TIMEOUT_S:.0f} s after the restart: expected {expected}, saw {seen}")


def restart(node: Node) -> tuple[float, float]:
    """Kill the node, leave it down DOWN_S, start it again; (its start time, the moment it was started)."""
    node.kill()
    time.sleep(DOWN_S)
    began = time.monotonic()
    return node.start(), began


@pytest.mark.timeout(240)
def test_the_first_server_restarted_with_new_swarm_rejoins_the_swarm(tiny_model_dir: Path, tmp_path: Path) -> None:
    first = server("first", tiny_model_dir, "0:3", tmp_path, "--new-swarm")
    nodes = [first]
    try:
        first.start()
        second = server("second", tiny_model_dir, "3:5", tmp_path, "--initial-peers", *first.peers)
        nodes.append(second)
        second.start()
        expected = {(peer_id(first), 0, 3), (peer_id(second), 3, 5)}
        wait_whole(nodes, expected, time.monotonic())
        started, began = restart(first)
        healed = wait_whole(nodes, expected, began)
        print(f"\nfirst server restarted: ready after {started:.1f} s, swarm whole after {healed:.1f} s")
    finally:
        for node in reversed(nodes):
            node.stop()


@pytest.mark.timeout(300)
def test_every_node_restarted_in_turn_rejoins_the_swarm(tiny_model_dir: Path, tmp_path: Path) -> None:
    entry = dht_node("entry", tmp_path)
    nodes = [entry]
    try:
        entry.start()
        for name, blocks in (("left", "0:3"), ("right", "3:5")):
            nodes.append(server(name, tiny_model_dir, blocks, tmp_path, "--initial-peers", *entry.peers))
            nodes[-1].start()
        expected = {(peer_id(nodes[1]), 0, 3), (peer_id(nodes[2]), 3, 5)}
        wait_whole(nodes, expected, time.monotonic())
        for node in nodes:
            started, began = restart(node)
            healed = wait_whole(nodes, expected, began)
            print(f"\n{node.name} restarted: ready after {started:.1f} s, swarm whole after {healed:.1f} s")
    finally:
        for node in reversed(nodes):
            node.stop()
