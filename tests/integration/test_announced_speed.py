"""The speed servers announce is stable: identical servers started together on one machine, and a server restarted,
announce the same tokens/s per block (measured once, warm, in rounds, then kept in the cache folder), and the record
says how the figure was found. `--throughput eval` measures again."""

from __future__ import annotations

from pathlib import Path

from swarmlm.server.speed import SPEED_FILE
from swarmlm.swarm.records import ServerRecord
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import connected_model


def records(model_dir: Path, swarm: LocalSwarm) -> dict[str, ServerRecord]:
    """The servers' records as a client reads them from the DHT."""
    with connected_model(model_dir, swarm) as model:
        return dict(model.model.layers.client.manager.servers)


def test_identical_servers_and_restarts_announce_the_same_speed(tiny_model_dir: Path, tmp_path: Path) -> None:
    swarm = LocalSwarm(str(tiny_model_dir), cache_dir=str(tmp_path / "cache"), threads_per_server=1)
    try:
        first, second = swarm.add_server(0, 5, wait=False), swarm.add_server(0, 5, wait=False)
        swarm.wait_ready([first, second])
        announced = records(tiny_model_dir, swarm)
        one, two = announced[first.peer_id], announced[second.peer_id]
        # started together: one measured (the other waited for it) and both announce its figure
        assert one.throughput == two.throughput
        assert one.inference_throughput == two.inference_throughput
        sources = sorted([one.throughput_source, two.throughput_source])
        assert sources[0].startswith("measured now") and sources[1].startswith("measured on this machine at")
        assert (tmp_path / "cache" / SPEED_FILE).exists()
        swarm.stop_server(first)
        restarted = swarm.add_server(1, 4)  # another span of the same model: the figure is per block
        again = records(tiny_model_dir, swarm)[restarted.peer_id]
        assert again.throughput == one.throughput and again.inference_throughput == one.inference_throughput
        assert again.throughput_source.startswith("measured on this machine at")
        serving = next(line for line in restarted.log_path.read_text().splitlines() if line.startswith("Serving "))
        assert f"{one.throughput:.0f} tokens/s per block (measured on this machine at" in serving
        remeasured = swarm.add_server(0, 5, extra_args=["--throughput", "eval"])
        assert records(tiny_model_dir, swarm)[remeasured.peer_id].throughput_source.startswith("measured now")
    finally:
        swarm.close()
