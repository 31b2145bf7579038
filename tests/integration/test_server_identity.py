"""`swarmlm serve --identity PATH`: the key file is created private at first start; the peer id survives restarts."""

from __future__ import annotations

import stat
from pathlib import Path

from swarmlm.swarm.keyfile import peer_id_of_file
from tests.conftest import running_swarm


def test_a_restarted_server_keeps_its_peer_id(tiny_model_dir: Path, tmp_path: Path) -> None:
    key = tmp_path / "ids" / "server.key"
    with running_swarm(tiny_model_dir, []) as swarm:
        first = swarm.add_server(0, 5, extra_args=["--identity", str(key)])
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        assert first.peer_id == peer_id_of_file(key)
        swarm.stop_server(first)
        again = swarm.add_server(0, 5, extra_args=["--identity", str(key)])
        assert again.peer_id == first.peer_id
