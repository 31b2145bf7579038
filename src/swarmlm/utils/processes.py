"""Every process swarmlm starts dies with its parent, including on SIGKILL of the parent."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

# prctl option that delivers a signal to a process when the thread that forked it exits (Linux only)
_PR_SET_PDEATHSIG = 1
# how often an orphan check runs in processes that cannot use prctl alone
PARENT_POLL_INTERVAL_S = 0.25
# setns(2)'s flag for a network namespace (<sched.h>)
_CLONE_NEWNET = 0x40000000


def enter_network_namespace(namespace_fd: int) -> None:
    """Move the calling thread into the network namespace open at `namespace_fd` (a /run/netns/NAME file, or a
    /proc/.../ns/net one): the sockets it opens, the threads it starts and the processes it starts live there.
    OSError when the kernel refuses (it takes CAP_SYS_ADMIN)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(namespace_fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns into a network namespace failed: {os.strerror(errno)}")


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (no-op off Linux)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed with errno %d", ctypes.get_errno())


def kill_group_when_orphaned(parent_pid: int) -> None:
    """Make this process lead its own group and kill the whole group (with its children) once orphaned.

    Used in children that start grandchildren we do not control (the DHT process starts p2pd): a parent-death
    signal would kill only this process and leave p2pd behind.
    """
    os.setpgid(0, 0)

    def kill_group(*_: object) -> None:
        os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGTERM, kill_group)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_INTERVAL_S)
        kill_group()

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def spawn_bound(args: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
    """Popen whose child receives SIGTERM if this process dies; the child then shuts down in order.

    The kernel ties the parent-death signal to the forking *thread*: a child forked by a short-lived thread would die
    with that thread. So every child is forked by one thread that lives as long as this process."""
    return start_spawner().submit(_popen, list(args), popen_kwargs).result()


def start_spawner() -> ThreadPoolExecutor:
    """The one thread that forks children (started now if not yet: it inherits the calling thread's namespaces)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarmlm-spawner")
            _spawner.submit(lambda: None).result()  # the thread starts on the first task
        return _spawner


def _popen(args: list[str], popen_kwargs: dict[str, Any]) -> subprocess.Popen:
    return subprocess.Popen(args, preexec_fn=set_parent_death_signal, **popen_kwargs)
