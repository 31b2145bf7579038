"""A swarm of real server processes on this machine (127.0.0.1), for the demo, tests and benchmarks."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from swarmlm.errors import SwarmError
from swarmlm.swarm.dht import ParentBoundDHT, start_dht, visible_maddrs
from swarmlm.swarm.private import load_swarm_key
from swarmlm.tools import prefork
from swarmlm.utils.processes import spawn_bound

logger = logging.getLogger(__name__)

READY_LINE = "Server ready: peer "
SERVING_LINE = "Serving blocks "  # then START:END; printed again after each move
# a server loads its blocks, measures itself and joins the DHT within this time on a small machine
SERVER_START_TIMEOUT_S = 180.0
# SIGTERM grace period before a server is killed: its drain (--drain-timeout, 30 s by default) and a margin
SERVER_STOP_TIMEOUT_S = 40.0


def even_spans(num_blocks: int, num_servers: int) -> list[tuple[int, int]]:
    """Split blocks 0:num_blocks into num_servers contiguous spans of near-equal size."""
    if not 1 <= num_servers <= num_blocks:
        raise SwarmError(f"cannot split {num_blocks} blocks over {num_servers} servers")
    bounds = [round(i * num_blocks / num_servers) for i in range(num_servers + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def child_env() -> dict[str, str]:
    """The environment of the processes a local swarm starts: this one's, output unbuffered (it is read line by line)
    and co-located processes sharing the cores (OpenMP threads that spin after their work would slow the next one)."""
    return {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PYTHONUNBUFFERED": "1"}


@dataclass
class LocalServer:
    start: int
    end: int
    process: subprocess.Popen
    log_path: Path
    peer_id: str | None = None
    _ready: threading.Event = field(default_factory=threading.Event)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class LocalSwarm:
    """A bootstrap DHT node in this process plus one `swarmlm serve` process per span; all die with this process."""

    def __init__(
        self,
        model: str,
        *,
        cache_dir: str | None = None,
        dht_prefix: str | None = None,
        threads_per_server: int | None = None,
        extra_args: Sequence[str] = (),
        swarm_key_file: str | None = None,
        bootstrap_host: str = "127.0.0.1",
        relay: bool = False,
    ):
        self.model, self.cache_dir, self.dht_prefix = model, cache_dir, dht_prefix
        self.swarm_key_file = swarm_key_file  # a private swarm: the bootstrap node and every server use this key
        self.threads_per_server, self.extra_args = threads_per_server, list(extra_args)
        self.log_dir = Path(tempfile.mkdtemp(prefix="swarmlm-logs-"))
        key = None if swarm_key_file is None else load_swarm_key(swarm_key_file)
        # every peer of a local swarm is reachable directly: NAT traversal would only add traffic
        # relay: the bootstrap node also relays for servers started behind NAT (`serve --relay`)
        self.dht: ParentBoundDHT = start_dht(
            host=bootstrap_host, nat_traversal=False, swarm_key=key, relay_service=relay
        )
        self.initial_peers = visible_maddrs(self.dht)
        self.servers: list[LocalServer] = []

    def add_server(
        self, start: int = 0, end: int = 0, *, num_blocks: int | None = None, wait: bool = True,
        extra_args: Sequence[str] = (),
    ) -> LocalServer:  # fmt: skip
        """A server for blocks start:end, or for num_blocks blocks it chooses (its start and end follow its moves)."""
        span = ["--num-blocks", str(num_blocks)] if num_blocks is not None else ["--blocks", f"{start}:{end}"]
        args = [
            sys.executable,
            "-m",
            "swarmlm.cli.main",
            "serve",
            str(self.model),
            *span,
            "--host",
            "127.0.0.1",
            "--initial-peers",
            *self.initial_peers,
            *self.extra_args,
            *extra_args,
        ]
        if self.cache_dir:
            args += ["--cache-dir", str(self.cache_dir)]
        if self.dht_prefix:
            args += ["--dht-prefix", self.dht_prefix]
        if self.swarm_key_file:
            args += ["--swarm-key", self.swarm_key_file]
        if self.threads_per_server:
            args += ["--num-threads", str(self.threads_per_server)]
        log_name = f"server-{len(self.servers)}-{'-'.join(span[1:]).replace(':', '-')}.log"
        return self.add_command(args, start, end, log_name, wait=wait)

    def add_command(self, args: list[str], start: int, end: int, log_name: str, wait: bool = True) -> LocalServer:
        """A server of blocks start:end started by the command `args` (`python -m swarmlm.cli.main serve ...`, or a
        script that wraps that command), its output logged to `log_name` in the swarm's log folder; stopped with
        the swarm."""
        process = self._launch(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env(), text=True)
        server = LocalServer(start, end, process, self.log_dir / log_name)
        threading.Thread(target=self._pump, args=(server,), daemon=True).start()
        self.servers.append(server)
        if wait:
            self.wait_ready([server])
        return server

    def _launch(self, args: list[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start one server's process (a hook: the emulated network starts each on its own host)."""
        # in a process group of its own: a Ctrl-C at the terminal reaches only the process that owns the swarm (the
        # chat's Ctrl-C stops an answer, not the servers), which stops the servers in order when it ends
        if prefork.should_fork(args, popen_kwargs):
            # forked from a process that imported the server's code once (tools/prefork.py): seconds of CPU less
            return prefork.launch(args, popen_kwargs.get("env") or os.environ)
        return spawn_bound(args, process_group=0, **popen_kwargs)

    def start_servers(self, spans: Sequence[tuple[int, int]]) -> list[LocalServer]:
        started = [self.add_server(start, end, wait=False) for start, end in spans]
        self.wait_ready(started)
        return started

    @staticmethod
    def _pump(server: LocalServer) -> None:
        # copy the server's output to its log and notice the ready line
        if server.process.stdout is None:
            raise ValueError("the server was started without a pipe for its output")
        with open(server.log_path, "w") as log:
            for line in server.process.stdout:
                log.write(line)
                log.flush()
                if line.startswith(SERVING_LINE):
                    start, end = line[len(SERVING_LINE) :].split(maxsplit=1)[0].split(":")
                    server.start, server.end = int(start), int(end)
                if line.startswith(READY_LINE):
                    server.peer_id = line[len(READY_LINE) :].strip()
                    server._ready.set()

    def wait_ready(self, servers: Sequence[LocalServer], timeout_s: float = SERVER_START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for server in servers:
            while not server._ready.wait(0.2):
                if server.process.poll() is not None or time.monotonic() > deadline:
                    raise SwarmError(
                        f"server for blocks {server.start}:{server.end} did not start "
                        f"(exit code {server.process.poll()}):\n{server.log_tail()}"
                    )

    def kill(self, server: LocalServer) -> None:
        """SIGKILL, as a crash or a pulled cable would look to the swarm. Returns once its helper processes (its p2p
        daemon, its DHT node), which die with it, are gone too: until then they hold its port."""
        try:
            helpers = psutil.Process(server.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            helpers = []
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        _, alive = psutil.wait_procs(helpers, timeout=SERVER_STOP_TIMEOUT_S)
        for helper in alive:
            logger.warning("a helper (pid %d) of the killed server %d:%d outlived it; killing it",
                           helper.pid, server.start, server.end)  # fmt: skip
            helper.kill()
        psutil.wait_procs(alive, timeout=SERVER_STOP_TIMEOUT_S)

    def stop_server(self, server: LocalServer) -> None:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
            try:
                server.process.wait(SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("server %d:%d ignored SIGTERM; killing it", server.start, server.end)
                server.process.kill()
                server.process.wait()

    def close(self) -> None:
        for server in self.servers:
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
        for server in self.servers:
            self.stop_server(server)
        self.dht.shutdown()
        shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_even_swarm(
    model_dir: str, num_blocks: int, num_servers: int, swarm_key_file: str | None = None
) -> LocalSwarm:
    """A local swarm of num_servers servers splitting the blocks evenly, the machine's cores shared among them;
    private with a swarm key file."""
    threads = max(1, (os.cpu_count() or 1) // num_servers)
    swarm = LocalSwarm(model_dir, threads_per_server=threads, swarm_key_file=swarm_key_file)
    try:
        swarm.start_servers(even_spans(num_blocks, num_servers))
    except BaseException:
        swarm.close()
        raise
    for server in swarm.servers:
        where = f"server ...{(server.peer_id or '?')[-6:]} (pid {server.process.pid})"
        print(f"  {where} serves blocks {server.start}:{server.end}", flush=True)
    return swarm
