"""A swarm over emulated hosts: the client and the bootstrap DHT on host 0, each server on a host of its own.

Each server listens on its host's loopback only, behind a delaying relay (netbed.relay) on the host's bridge address,
and announces the relay (`--announce-maddrs`): every byte to or from a server crosses the emulated link, with the
delay and rate of that server's link, and bandwidth caps apply per host (tc tbf). Servers are real `swarmlm serve`
processes; the client is built inside `swarm.client_side()` so that its DHT and p2pd live on host 0.

A server behind NAT (Link(behind_nat=True)) gets no such relay: nothing on its host accepts connections from other
hosts, and it is dialled through the bootstrap node's libp2p relay (`serve --relay`), which it connects to itself.
"""

from __future__ import annotations

import select
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from swarmlm.errors import SwarmError
from swarmlm.tools.local_swarm import LocalServer, LocalSwarm
from swarmlm.tools.netbed.hosts import Host, NetBed
from swarmlm.tools.netbed.relay import READY_LINE

# every server listens on this port of its own host (hosts do not share ports)
SERVER_PORT = 31337
# a relay starts within this time
RELAY_START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Link:
    """How far a server's host is from everyone else."""

    delay_ms: float = 0.0  # one-way delay, added in each direction by the relay
    rate_mbit: float = 0.0  # the host's bandwidth in each direction (tc tbf; 0: unlimited)
    behind_nat: bool = False  # the host accepts no inbound connections: reached through the bootstrap's relay


class NetSwarm(LocalSwarm):
    """LocalSwarm over a NetBed: servers are added with add_server(..., link=...) one host each (see module doc)."""

    def __init__(self, model: str, *, max_servers: int = 4, client_rate_mbit: float = 0.0, **kwargs: Any):
        self.bed = NetBed(max_servers + 1)
        try:
            if client_rate_mbit > 0:
                self.bed.set_rate(self.client_host, client_rate_mbit)
            with self.bed.inside(self.client_host):
                super().__init__(model, bootstrap_host=self.client_host.address, relay=True, **kwargs)
        except BaseException:
            self.bed.close()
            raise
        self._next_link = Link()
        self.hosts_used = 0
        self.relays: dict[int, subprocess.Popen] = {}  # server process pid -> its relay
        self.links: dict[int, Link] = {}  # server process pid -> its link

    @property
    def client_host(self) -> Host:
        return self.bed.hosts[0]

    @contextmanager
    def client_side(self) -> Iterator[None]:
        """Build clients inside this block: their DHT node and p2pd then run on host 0."""
        with self.bed.inside(self.client_host):
            yield

    def add_server(self, start: int = 0, end: int = 0, *, link: Link = Link(), **kwargs: Any) -> LocalServer:
        self._next_link = link
        return super().add_server(start, end, **kwargs)

    def start_servers(
        self, spans: Sequence[tuple[int, int]], links: Sequence[Link] | None = None
    ) -> list[LocalServer]:
        links = list(links) if links is not None else [Link()] * len(spans)
        started = [self.add_server(s, e, link=link, wait=False) for (s, e), link in zip(spans, links, strict=True)]
        self.wait_ready(started)
        return started

    def _launch(self, args: list[str], **popen_kwargs: Any) -> subprocess.Popen:
        if self.hosts_used + 1 >= len(self.bed.hosts):
            raise SwarmError(f"this bed has room for {len(self.bed.hosts) - 1} servers")
        self.hosts_used += 1
        host, link = self.bed.hosts[self.hosts_used], self._next_link
        if link.rate_mbit > 0:
            self.bed.set_rate(host, link.rate_mbit)
        if link.behind_nat:
            return self._launch_behind_nat(host, link, args, **popen_kwargs)
        relay = self.bed.spawn(host, [
            sys.executable, "-m", "swarmlm.tools.netbed.relay", "--listen", f"{host.address}:{SERVER_PORT}",
            "--to", f"127.0.0.1:{SERVER_PORT}", "--delay-ms", str(link.delay_ms),
        ], stdout=subprocess.PIPE, text=True)  # fmt: skip
        _wait_ready(relay)
        announce = f"/ip4/{host.address}/tcp/{SERVER_PORT}"
        process = self.bed.spawn(
            host, [*args, "--port", str(SERVER_PORT), "--announce-maddrs", announce], **popen_kwargs
        )
        self.relays[process.pid], self.links[process.pid] = relay, link
        return process

    def _launch_behind_nat(self, host: Host, link: Link, args: list[str], **popen_kwargs: Any) -> subprocess.Popen:
        """The server listens on its host's loopback only (no other host can connect to it) and keeps a reservation
        on the bootstrap node's relay, through which it is dialled."""
        if link.delay_ms > 0:
            raise SwarmError("a link behind NAT has no delaying relay: its delay cannot be emulated")
        process = self.bed.spawn(
            host, [*args, "--port", str(SERVER_PORT), "--relay", *self.initial_peers], **popen_kwargs
        )
        self.links[process.pid] = link
        return process

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.bed.close()


def _wait_ready(relay: subprocess.Popen) -> None:
    """Wait for the relay's one line (it prints it once listening), or fail by the deadline."""
    if relay.stdout is None:
        raise SwarmError("the relay was started without a pipe for its output")
    ready, _, _ = select.select([relay.stdout], [], [], RELAY_START_TIMEOUT_S)
    line = relay.stdout.readline() if ready else ""
    if not line.startswith(READY_LINE):
        relay.kill()
        raise SwarmError(f"the relay did not start (exit code {relay.poll()}): {line!r}")
