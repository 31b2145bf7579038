"""Server processes forked from one that imported the server's code once, for swarms that start many servers.

Importing torch, transformers and hivemind costs a `swarmlm serve` process about 4 s of CPU before it does
anything; a test suite or benchmark that starts hundreds of servers spends most of its time there. A forker is a
process (bound to this one) that imports the server's modules once, then forks a child for each server asked for:
the child sets the environment, working directory and output it was given and runs the named module's `main` with the
command line, as `python -m swarmlm.cli.main` would. Everything after the fork is the ordinary server.

What a fork cannot change: modules read some environment variables when they are imported (OpenMP's wait policy,
huggingface_hub's endpoint and cache), so a forker serves only the environment it was started with, and another
environment gets its own forker. Children die with their forker, which dies with this process, as spawned servers
die with it (utils/processes.py).

`LocalSwarm` uses it when SWARMLM_PREFORK=1 (the test suite sets it); otherwise servers are spawned as usual. A forker
runs any `python -m swarmlm.cli.main ...` command line (the tests' `swarmlm api` and `monitor` processes too) and
Python scripts that wrap one (the tests' altered servers).
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import logging
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from swarmlm.errors import SwarmError
from swarmlm.utils.processes import enter_network_namespace, set_parent_death_signal, spawn_bound

logger = logging.getLogger(__name__)

ENV_SWITCH = "SWARMLM_PREFORK"
# the command line a forker can run: `python -m swarmlm.cli.main ...`
MODULE = "swarmlm.cli.main"
# what `swarmlm serve` imports before it loads a model: importing it here is the point of the forker
PRELOAD = ("swarmlm.cli.main", "swarmlm.server.server", "swarmlm.models.span", "swarmlm.models.registry")
# a forker that has not imported its modules within this time is broken (it takes ~5 s on a loaded 2-core machine)
READY_TIMEOUT_S = 120.0
# how often the forker reaps its children when no request arrives
REAP_INTERVAL_S = 0.1
_HEADER = struct.Struct("!I")
# forkers kept per process (one per environment): each holds ~0.5 GB of imported modules
MAX_FORKERS = 3


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "") == "1"


def should_fork(args: Sequence[str], popen_kwargs: Mapping[str, Any]) -> bool:
    """Whether a process asked for with these Popen arguments is forked rather than spawned: forking is on, the
    command line is one a forker runs, and nothing is asked of the process that a forked child cannot give (its
    output, errors, environment and text mode only)."""
    return enabled() and can_fork(args) and set(popen_kwargs) <= {"stdout", "stderr", "env", "text"}


def can_fork(args: Sequence[str]) -> bool:
    """Whether `args` is a command line a forker runs: this interpreter with `-m swarmlm.cli.main`, or with a Python
    script (one that wraps that command, as the tests' altered servers do)."""
    if len(args) < 2 or args[0] != sys.executable:
        return False
    return (len(args) >= 3 and args[1] == "-m" and args[2] == MODULE) or args[1].endswith(".py")


class ForkedProcess:
    """A child of a forker, with the part of subprocess.Popen's interface that servers' owners use."""

    def __init__(self, forker: Forker, pid: int, stdout: IO[str] | None, stderr: IO[str] | None = None):
        self.forker, self.pid, self.stdout, self.stderr = forker, pid, stdout, stderr
        self.args: list[str] = []
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.forker.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.forker.wait_for_exit(self.pid, left)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forker:
    """One forker process for one environment; `launch` is thread-safe."""

    def __init__(self, env: Mapping[str, str]):
        self.env = dict(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # in a process group of its own, as each server is: a Ctrl-C at the terminal (the chat's, stopping an
        # answer) must not reach the process whose death takes the servers down
        self.process = spawn_bound(
            [sys.executable, "-m", "swarmlm.tools.prefork", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=self.env, stdin=subprocess.DEVNULL, process_group=0,
        )  # fmt: skip
        theirs.close()
        self.sock = ours
        self._send_lock = threading.Lock()
        self._changed = threading.Condition()
        self._started: dict[int, int] = {}  # request number -> pid
        self._exits: dict[int, int] = {}  # pid -> exit code (negative: killed by that signal), as Popen reports it
        self._live: set[int] = set()  # children not yet exited
        self._requests = 0
        self._closed = False
        threading.Thread(target=self._read_replies, name="swarmlm-prefork", daemon=True).start()

    def launch(
        self, args: Sequence[str], env: Mapping[str, str], cwd: str | None, process_group: bool,
        split_errors: bool = False, netns: str | None = None,
    ) -> ForkedProcess:  # fmt: skip
        """Fork a child running `args` (see can_fork), its output into a pipe (its errors too, or into a second pipe
        with split_errors), in network namespace `netns` if given."""
        pipes = [os.pipe() for _ in range(2 if split_errors else 1)]
        read_ends, write_ends = [r for r, _ in pipes], [w for _, w in pipes]
        with self._send_lock:
            self._requests += 1
            number = self._requests
            command = (
                {"module": args[2], "argv": list(args[3:])}
                if args[1] == "-m"
                else {"script": os.path.abspath(args[1]), "argv": list(args[2:])}
            )
            request = {"number": number, **command, "env": dict(env), "cwd": cwd or os.getcwd(),
                       "process_group": process_group, "split_errors": split_errors, "netns": netns}  # fmt: skip
            payload = json.dumps(request).encode()
            try:
                socket.send_fds(self.sock, [_HEADER.pack(len(payload)) + payload], write_ends)
            except OSError as e:
                for fd in read_ends:
                    os.close(fd)
                raise SwarmError(f"the server forker is gone ({e})") from e
            finally:
                for fd in write_ends:
                    os.close(fd)
        deadline = time.monotonic() + READY_TIMEOUT_S
        with self._changed:
            while number not in self._started:
                if self._closed or time.monotonic() > deadline:
                    for fd in read_ends:
                        os.close(fd)
                    raise SwarmError(f"the server forker did not start a server (exit code {self.process.poll()})")
                self._changed.wait(0.5)
            pid = self._started.pop(number)
        streams = [os.fdopen(fd, "r", errors="replace") for fd in read_ends]
        process = ForkedProcess(self, pid, *streams)
        process.args = list(args)
        return process

    @property
    def idle(self) -> bool:
        with self._changed:
            return not self._live and not self._started

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the forker (its children, if any are left, die with it)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.sock.close()

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            if pid in self._exits:
                return self._exits[pid]
            if self._closed:
                return -signal.SIGKILL  # the forker died: so did its children (parent-death signal)
        return None

    def wait_for_exit(self, pid: int, timeout: float | None) -> None:
        with self._changed:
            if pid not in self._exits and not self._closed:
                self._changed.wait(0.5 if timeout is None else min(timeout, 0.5))

    def _read_replies(self) -> None:
        buffer = b""
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            with self._changed:
                for line in lines:
                    kind, first, second = line.decode().split()
                    if kind == "started":
                        self._started[int(first)] = int(second)
                        self._live.add(int(second))
                    elif kind == "exited":
                        self._exits[int(first)] = int(second)
                        self._live.discard(int(first))
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()


# variables no import reads, and which change often: pytest names the running test in one
_IGNORED_ENV = ("PYTEST_CURRENT_TEST",)
# this project's own variables are read when its commands run, never when its modules are imported (an API key, the
# request log's switch): a child sets them before it runs its command
_IGNORED_PREFIX = "SWARMLM_"


def _import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of `env` that tells forkers apart: what imports might read."""
    return {
        name: value
        for name, value in env.items()
        if name not in _IGNORED_ENV and not (name.startswith(_IGNORED_PREFIX) and name != ENV_SWITCH)
    }


_forkers: dict[str, Forker] = {}
_forkers_lock = threading.Lock()


def launch(
    args: Sequence[str], env: Mapping[str, str], cwd: str | None = None, process_group: bool = True,
    split_errors: bool = False, netns: str | None = None,
) -> Any:  # fmt: skip
    """A forked `args` (see can_fork) with `env`, from the forker of that environment (started now if none is);
    netns: the network namespace (/run/netns/NAME) it runs in, as under `ip netns exec NAME`."""
    key = hashlib.sha256(json.dumps(sorted(_import_env(env).items())).encode()).hexdigest()
    idle: list[Forker] = []
    with _forkers_lock:
        forker = _forkers.pop(key, None)
        if forker is None or forker._closed:
            forker = Forker(env)
        _forkers[key] = forker  # the most recently used last
        if len(_forkers) > MAX_FORKERS:
            # tests that change the environment leave forkers behind: stop the least recently used idle ones
            keys = [k for k, f in _forkers.items() if f is not forker and f.idle][: len(_forkers) - MAX_FORKERS]
            idle = [_forkers.pop(k) for k in keys]
    for old in idle:
        old.close()
    return forker.launch(args, env, cwd, process_group, split_errors, netns)


def run(
    args: Sequence[str], env: Mapping[str, str], timeout: float, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    """subprocess.run(args, env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True) for a command a forker
    runs: the same result (output and errors apart), the child killed and TimeoutExpired raised past the timeout."""
    process = launch(args, env, cwd, process_group=False, split_errors=True)
    read: dict[str, str] = {}
    readers = [
        threading.Thread(target=lambda name=name, stream=stream: read.__setitem__(name, stream.read()), daemon=True)
        for name, stream in (("out", process.stdout), ("err", process.stderr))
    ]
    for reader in readers:
        reader.start()
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    finally:
        for reader in readers:
            reader.join(5.0)
        process.stdout.close()
        process.stderr.close()
    return subprocess.CompletedProcess(list(args), code, read.get("out", ""), read.get("err", ""))


def forker_pids() -> set[int]:
    """The live forkers of this process: helpers that live as long as it does by design (not the servers they fork),
    for checks that everything a piece of work started has ended."""
    with _forkers_lock:
        return {forker.process.pid for forker in _forkers.values() if forker.process.poll() is None}


def close_all(timeout_s: float = 10.0) -> None:
    """Stop every forker of this process (their children, if any are left, die with them)."""
    with _forkers_lock:
        forkers = list(_forkers.values())
        _forkers.clear()
    for forker in forkers:
        forker.close(timeout_s)


# ----- the forker process -----


def _serve(sock: socket.socket) -> None:
    for module in PRELOAD:
        importlib.import_module(module)
    if threading.active_count() > 1:
        # a fork copies only the forking thread: a lock another thread holds would stay locked in every child
        raise SystemExit(f"prefork: importing {PRELOAD} started threads; forking is unsafe")
    children: set[int] = set()
    buffer = b""
    while True:
        readable, _, _ = select.select([sock], [], [], REAP_INTERVAL_S)
        _reap(sock, children)
        if not readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
        if not data:
            return  # the owner is gone; the children follow by their parent-death signal
        buffer += data
        while len(buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer)
            if len(buffer) < _HEADER.size + length:
                break
            request = json.loads(buffer[_HEADER.size : _HEADER.size + length])
            buffer = buffer[_HEADER.size + length :]
            output = fds.pop(0)
            errors = fds.pop(0) if request.get("split_errors") else None
            pid = os.fork()
            if pid == 0:
                _child(sock, request, output, errors)  # never returns
            os.close(output)
            if errors is not None:
                os.close(errors)
            children.add(pid)
            sock.sendall(f"started {request['number']} {pid}\n".encode())


def _reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            children.discard(pid)
            continue
        if done:
            children.discard(pid)
            sock.sendall(f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def _child(sock: socket.socket, request: dict[str, Any], output: int, errors: int | None) -> None:
    code: object = 1
    try:
        sock.close()
        if request["process_group"]:
            os.setpgid(0, 0)
        set_parent_death_signal(signal.SIGTERM)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(output, 1)
        os.dup2(output if errors is None else errors, 2)
        os.close(output)
        if errors is not None:
            os.close(errors)
        os.close(devnull)
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(line_buffering=True)
        if request.get("netns"):
            _enter_netns(request["netns"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request.get("script") or request["module"], *request["argv"]]
        # children of one forker would share its random states: seed them anew, as a new process would be
        import random

        import torch

        random.seed()
        torch.seed()
        if "script" in request:  # as `python SCRIPT ARGS` runs it: its folder first on the path, named __main__
            script = request["script"]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
            code = 0
        else:  # the module is named by the command line, as `python -m` names it (the forker runs commands, not code)
            code = importlib.import_module(request["module"]).main(request["argv"])
        # what the interpreter does at exit after `python -m`: join the threads left, then run the exit handlers
        # (multiprocessing's stops the DHT's process)
        threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - a child must never return into the forker's loop
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _enter_netns(name: str) -> None:
    """Move this process (just forked: its one thread) into the network namespace `name`, as `ip netns exec` does."""
    with open(f"/run/netns/{name}") as target:
        enter_network_namespace(target.fileno())


def _main() -> None:
    set_parent_death_signal(signal.SIGKILL)
    sock = socket.socket(fileno=int(sys.argv[1]))
    _serve(sock)


if __name__ == "__main__":
    _main()
