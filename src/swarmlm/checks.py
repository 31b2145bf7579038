"""Checks of option values and addresses shared by the command line and the configs; each error names the option.

Light to import (no torch, no hivemind: those cost seconds), so that `swarmlm` refuses bad input before it loads or
starts anything.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import socket
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import base58

from swarmlm.errors import ConfigError, SwarmError


@dataclass(frozen=True)
class Range:
    """The numbers an option takes: from `low` (excluded when `open_low`) up to `high`; integers only if `integer`."""

    low: float
    open_low: bool = False
    high: float | None = None
    integer: bool = False

    def accepts(self, value: object) -> bool:
        # bool is an int to Python, never a count or a duration to a user
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not math.isfinite(value):
            return False
        above_low = value > self.low if self.open_low else value >= self.low
        return above_low and (self.high is None or value <= self.high)

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.high is not None:
            return f"{kind} {'above' if self.open_low else 'from'} {self.low:g} up to {self.high:g}"
        return f"{kind} above {self.low:g}" if self.open_low else f"{kind} of {self.low:g} or more"


POSITIVE_INT = Range(1, integer=True)  # sizes and counts of things to run: 0 would run nothing
COUNT = Range(0, integer=True)  # counts where 0 means none (retries, checks)
POSITIVE = Range(0, open_low=True)  # durations and sizes that must be some length
NON_NEGATIVE = Range(0)  # durations where 0 turns a wait or a feature off
FRACTION = Range(0, open_low=True, high=1)  # shares of something: all of it at most, never none
PROBABILITY = Range(0, high=1)
PORT = Range(0, high=65535, integer=True)  # 0: any free port

# multihash codes a peer id is made with: identity (small public keys, e.g. Ed25519: 12D3KooW...) and sha2-256 (Qm...)
_PEER_ID_HASHES = (0x00, 0x12)
PEER_MADDR_EXAMPLE = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."


def check_range(name: str, value: object, allowed: Range) -> None:
    if not allowed.accepts(value):
        raise ConfigError(f"{name} must be {allowed.describe()}, not {value!r}")


def check_peer_maddrs(maddrs: Sequence[str], name: str) -> None:
    """Raise ConfigError unless every address has a peer multiaddr's shape: /<transport parts>/p2p/<peer id>.

    Only the shape and the peer id are checked here; p2pd parses the transport parts when it starts (its error for
    those is passed on by swarm/dht.py)."""
    if isinstance(maddrs, str | bytes):
        raise ConfigError(f"{name} must be a list of multiaddrs, not one string")
    for maddr in maddrs:
        problem = _peer_maddr_problem(maddr)
        if problem is not None:
            raise ConfigError(f"{name}: {maddr!r} is not a peer's multiaddr ({problem}); a peer's address looks like "
                              f"{PEER_MADDR_EXAMPLE}")  # fmt: skip


def _peer_maddr_problem(maddr: object) -> str | None:
    if not isinstance(maddr, str):
        return "not a string"
    if not maddr.startswith("/"):
        return "it must begin with /"
    head, _, peer = maddr.rpartition("/p2p/")
    if not head or "/" in peer:
        return "it must end with /p2p/ and the peer's id"
    return None if is_peer_id(peer) else f"{peer!r} is not a peer id"


def is_peer_id(text: str) -> bool:
    """Whether `text` is a base58 peer id: a multihash (code, digest length, digest) of the peer's public key."""
    try:
        raw = base58.b58decode(text)
    except ValueError:
        return False
    return len(raw) > 2 and raw[0] in _PEER_ID_HASHES and raw[1] == len(raw) - 2


def check_ip_host(host: str, name: str = "--host") -> None:
    """p2pd listens on /ip4/<host> or /ip6/<host> addresses: a host name (even localhost) is not one."""
    try:
        ipaddress.ip_address(host)
    except ValueError as e:
        raise ConfigError(
            f"{name} must be an IP address such as 0.0.0.0 (all interfaces) or 127.0.0.1, not {host!r}"
        ) from e


def check_can_listen(host: str, port: int, port_flag: str = "--port", host_flag: str = "--host") -> None:
    """Raise SwarmError unless a TCP listener on host:port could start now without sharing the port.

    p2pd binds with SO_REUSEPORT, so a second p2pd on a port already taken starts beside the first and the kernel
    splits incoming connections between them; a socket without SO_REUSEPORT is refused by any listener there. With
    SO_REUSEADDR, connections of an earlier run still in TIME_WAIT on the port do not count, as for the real listener.
    Port 0 (any free port) still checks that the host is an address of this machine.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as e:
        raise SwarmError(f"{host_flag} {host}: not an address of this machine ({e})") from e
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise SwarmError(_bind_problem(host, port, port_flag, host_flag, e)) from e


def _bind_problem(host: str, port: int, port_flag: str, host_flag: str, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        return (f"{port_flag} {port}: the port is already in use on {host} (by another server or node?); choose "
                f"another {port_flag} or stop the process listening there")  # fmt: skip
    if error.errno == errno.EADDRNOTAVAIL:
        return f"{host_flag} {host}: not an address of this machine (0.0.0.0 listens on all of them)"
    if error.errno == errno.EACCES:
        return f"{port_flag} {port}: permission denied (ports below 1024 need privileges)"
    return f"cannot listen on {host}:{port}: {error.strerror}"


def check_private_file(path: Path, name: str) -> None:
    """Raise ConfigError unless `path` is a regular file only its owner may access (a key others can read is no
    secret)."""
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{name} {path} is not a regular file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{name} {path} is accessible by others (mode {oct(mode & 0o777)}); chmod 600 {path}")


def check_device(name: str) -> None:
    """Raise ConfigError unless `name` is a torch device this machine has (torch fails late and obscurely)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"--device {name!r} is not a torch device (cpu, cuda, cuda:1, mps, ...)") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: this machine (or this build of torch) has no CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: there are only {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {name}: MPS is not available on this machine")


# --- checks of one config field each: (field name, value) -> None or ConfigError (config.py's tables) ---

Check = Callable[[str, object], None]


def in_range(allowed: Range) -> Check:
    return lambda name, value: check_range(name, value, allowed)


def optional_text(name: str, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{name} must be a string or None, not {value!r}")


def string_list(name: str, value: object) -> None:
    """A list, tuple or set of strings; a single string is refused: it would be read as its characters."""
    if isinstance(value, str) or not isinstance(value, list | tuple | set | frozenset):
        raise ConfigError(f"{name} must be a list of strings, not {value!r}")
    if not all(isinstance(item, str) for item in value):
        raise ConfigError(f"{name} must hold strings only, not {value!r}")


def optional_string_list(name: str, value: object) -> None:
    if value is not None:
        string_list(name, value)


def boolean(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, not {value!r}")


def peers(name: str, value: object) -> None:
    string_list(name, value)
    check_peer_maddrs(value, name)  # type: ignore[arg-type]  # a sequence of str, checked just above


def swarm_key_value(name: str, value: object) -> None:
    if value is not None and not (isinstance(value, bytes) and len(value) == 32):
        given = f"{len(value)} bytes" if isinstance(value, bytes) else repr(value)  # a secret is never shown
        raise ConfigError(f"{name} must be a swarm key file's path or its 32-byte secret, not {given}")
