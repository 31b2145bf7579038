"""The soak's resource sampling skips a server caught while it exits instead of recording zero memory."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import psutil

from swarmlm.tools.soak import sample


@dataclass
class _Unreaped:
    """A process handle whose poll() has not yet seen the exit, as between a kill and the next waitpid."""

    process: Any

    def poll(self) -> None:
        return None

    @property
    def pid(self) -> int:
        return int(self.process.pid)


@dataclass
class _Server:
    process: Any


@dataclass
class _Swarm:
    servers: list[_Server]


def test_a_running_server_is_sampled_and_an_exiting_one_is_skipped() -> None:
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(exited.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        swarm = _Swarm([_Server(alive), _Server(_Unreaped(exited))])
        rows = sample(swarm, 1.0)  # type: ignore[arg-type]
        assert [row.server for row in rows] == ["s0"]
        assert rows[0].rss_mb > 0 and rows[0].fds > 0 and rows[0].pid == alive.pid
    finally:
        alive.kill()
        alive.wait()
        exited.wait()
