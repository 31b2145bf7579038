"""Emulated hosts on one Linux machine: one network namespace per host, joined by veth pairs to a private bridge.

    root namespace:   bridge (no address: the root namespace neither sees nor routes the hosts' traffic)
                        |-- veth -- host 0 (10.213.0.2/24, loopback up)  [tbf both ways: the host's bandwidth]
                        |-- veth -- host 1 (10.213.0.3/24)
                        ...

Every name carries this process's pid and a counter, so parallel runs never collide, and a later run removes what
a killed one left behind (names whose pid is dead). Needs root and iproute2 (`ip`, `tc`); `unavailable()` says why
not, for tests to skip. Everything made is removed by close(), also when creation fails half-way.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from swarmlm.errors import SwarmError
from swarmlm.tools import prefork
from swarmlm.utils.processes import enter_network_namespace, spawn_bound, start_spawner

logger = logging.getLogger(__name__)

# the hosts' private subnet: it exists only on the bridge and inside the namespaces, never in the root namespace
SUBNET_PREFIX = "10.213.0."
NETMASK_BITS = 24
# the first host gets .2 (.1 stays free, as for a gateway)
FIRST_HOST_OCTET = 2
# a bed of more hosts than this is a mistake (addresses, names and processes must stay bounded)
MAX_HOSTS = 16
# longest an `ip`/`tc` command may take
COMMAND_TIMEOUT_S = 10.0
# token bucket of a rate-limited link: burst and queueing latency bound how far the rate may overshoot
TBF_BURST_BYTES = 64 << 10
TBF_LATENCY_MS = 200
# names: "swlm<pid>x<n>h<i>" for namespaces, "swb<pid hex>x<n>" for bridges (interface names have 15 bytes at most)
_NS_NAME = re.compile(r"^swlm(\d+)x(\d+)h(\d+)$")
_BRIDGE_NAME = re.compile(r"^swb([0-9a-f]+)x([0-9a-f]+)$")
_counter = itertools.count()
_counter_lock = threading.Lock()


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, veth pairs, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated hosts need iproute2's `{tool}`, not found"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _run(*args: str) -> str:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if result.returncode != 0:
        raise SwarmError(f"`{' '.join(args)}` failed: {result.stderr.strip()}")
    return result.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans() -> list[str]:
    """Remove namespaces and bridges of beds whose process is gone (a killed test run); returns what was removed."""
    removed = []
    for line in _run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NS_NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=COMMAND_TIMEOUT_S)
            removed.append(name)
    for name in bed_links():
        match = _BRIDGE_NAME.match(name)
        if match and not _pid_alive(int(match.group(1), 16)):
            subprocess.run(["ip", "link", "delete", name], capture_output=True, timeout=COMMAND_TIMEOUT_S)
            removed.append(name)
    return removed


def bed_links() -> list[str]:
    """Interfaces in the root namespace that beds made (bridges and veth ends)."""
    names = [line.split(":")[1].strip().split("@")[0] for line in _run("ip", "-o", "link", "show").splitlines()]
    return [name for name in names if name.startswith(("swb", "swv"))]


def bed_namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if _NS_NAME.match(line.split()[0])]


@dataclass(frozen=True)
class Host:
    """One emulated host: a namespace with one address on the bed's bridge."""

    name: str  # the namespace
    address: str  # its IPv4 address on the bridge
    device: str  # its interface inside the namespace
    outer_device: str  # the other end of its veth pair, on the bridge

    def command(self, args: Sequence[str]) -> list[str]:
        """`args` run inside this host."""
        return ["ip", "netns", "exec", self.name, *args]


class NetBed:
    """Emulated hosts on a private bridge; use as a context manager or call close()."""

    def __init__(self, num_hosts: int, *, rate_mbit: float | Sequence[float] = 0.0):
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise SwarmError(f"a bed has 1..{MAX_HOSTS} hosts, not {num_hosts}")
        reason = unavailable()
        if reason is not None:
            raise SwarmError(reason)
        remove_orphans()
        with _counter_lock:
            run = next(_counter)
        self.pid = os.getpid()
        self._ns_prefix = f"swlm{self.pid}x{run}h"
        self._tag = f"{self.pid:x}x{run:x}"
        self.bridge = f"swb{self._tag}"
        self.hosts: list[Host] = []
        self.processes: list[subprocess.Popen] = []
        self._closed = False
        rates = [rate_mbit] * num_hosts if isinstance(rate_mbit, int | float) else list(rate_mbit)
        if len(rates) != num_hosts:
            raise SwarmError(f"{len(rates)} rates given for {num_hosts} hosts")
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "link", "set", self.bridge, "up")
            for index, rate in enumerate(rates):
                self.hosts.append(self._add_host(index, rate))
        except BaseException:
            self.close()
            raise

    def _add_host(self, index: int, rate_mbit: float) -> Host:
        name = f"{self._ns_prefix}{index}"
        outer, inner = f"swv{self._tag}o{index}", f"swv{self._tag}i{index}"
        host = Host(name, f"{SUBNET_PREFIX}{FIRST_HOST_OCTET + index}", inner, outer)
        _run("ip", "netns", "add", name)
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", inner, "netns", name)
        _run("ip", "link", "set", outer, "master", self.bridge, "up")
        inside = ["ip", "netns", "exec", name]
        _run(*inside, "ip", "addr", "add", f"{host.address}/{NETMASK_BITS}", "dev", inner)
        _run(*inside, "ip", "link", "set", inner, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        if rate_mbit > 0:
            self.set_rate(host, rate_mbit)
        return host

    def set_rate(self, host: Host, rate_mbit: float) -> None:
        """Cap the host's link at rate_mbit in each direction (tbf on both ends of its veth pair)."""
        shape = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(TBF_BURST_BYTES), "latency", f"{TBF_LATENCY_MS}ms"]
        _run("ip", "netns", "exec", host.name, "tc", "qdisc", "replace", "dev", host.device, "root", *shape)
        _run("tc", "qdisc", "replace", "dev", host.outer_device, "root", *shape)

    def spawn(self, host: Host, args: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """A process inside `host` that dies with this process (parent-death signal); killed by close(). A server's
        command line is forked into the namespace when servers are forked (tools/prefork.py), as LocalSwarm's are."""
        if prefork.should_fork(args, popen_kwargs):
            process = prefork.launch(args, popen_kwargs.get("env") or os.environ, netns=host.name)
        else:
            process = spawn_bound(host.command(args), **popen_kwargs)
        self.processes.append(process)
        return process

    @contextmanager
    def inside(self, host: Host) -> Iterator[None]:
        """Run the block with this thread in `host`'s namespace: sockets it opens, threads it starts and processes
        it forks live there (and stay there after the block). The thread returns to its namespace afterwards."""
        start_spawner()  # the long-lived thread that forks servers must stay in this thread's own namespace
        with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{host.name}") as target:
            try:
                enter_network_namespace(target.fileno())
            except OSError as e:
                raise SwarmError(f"cannot enter {host.name}: {e}") from e
            try:
                yield
            finally:
                try:
                    enter_network_namespace(home.fileno())
                except OSError as e:
                    raise SwarmError(f"cannot return from {host.name}: {e}") from e

    def close(self) -> None:
        """Kill the bed's processes, then remove its namespaces and bridge (their veth pairs go with them)."""
        if self._closed:
            return
        self._closed = True
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            try:
                process.wait(COMMAND_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("process %d inside the bed did not die", process.pid)
        for name in [h.name for h in self.hosts] + [n for n in bed_namespaces() if n.startswith(self._ns_prefix)]:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=COMMAND_TIMEOUT_S)
        for name in [self.bridge] + self._links():
            subprocess.run(["ip", "link", "delete", name], capture_output=True, timeout=COMMAND_TIMEOUT_S)

    def leftovers(self) -> list[str]:
        """Namespaces and interfaces of this bed that still exist (empty after close())."""
        names = [n for n in bed_namespaces() if n.startswith(self._ns_prefix)]
        return names + self._links()

    def _links(self) -> list[str]:
        mine = (self.bridge, f"swv{self._tag}o", f"swv{self._tag}i")  # the run counter is hex: never "o" or "i"
        return [name for name in bed_links() if name == self.bridge or name.startswith(mine[1:])]

    def __enter__(self) -> NetBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
