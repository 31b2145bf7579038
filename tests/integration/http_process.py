"""Real `swarmlm api` / `swarmlm monitor` processes for tests: bound to the test process, stopped by SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from swarmlm.tools import prefork
from swarmlm.tools.local_swarm import child_env
from swarmlm.utils.processes import spawn_bound

SWARMLM = [sys.executable, "-m", "swarmlm.cli.main"]
# loading the client's parts of SmolLM2 and joining the DHT takes a few seconds; generous on a busy machine
START_TIMEOUT_S = 120.0


@contextmanager
def http_process(args: list[str], ready_line: str, output: list[str] | None = None) -> Iterator[str]:
    """Run `swarmlm ARGS` until its ready line and yield the base URL it prints; its output is echoed on failure
    (and its lines added to `output` as they come, if given)."""
    with http_server(args, ready_line, stopped_by_test=False, output=output) as (url, _):
        yield url


@contextmanager
def api_process(model_dir: Path, initial_peers: Sequence[str], name: str, *extra: str) -> Iterator[str]:
    """A `swarmlm api` of the model in `model_dir` serving it as `name` through the swarm at `initial_peers` (with
    `extra` flags) on a free port; yields its base URL."""
    from swarmlm.api.service import READY_LINE

    args = ["api", str(model_dir), "--served-model-name", name, "--port", "0", *extra]
    with http_process([*args, "--initial-peers", *initial_peers], READY_LINE) as url:
        yield url


Process = subprocess.Popen[str] | prefork.ForkedProcess


def _start(command: list[str]) -> Process:
    """The process, output and errors in one text pipe. Forked as the suite's servers are, from the same forker (the
    environment LocalSwarm gives its servers) when SWARMLM_PREFORK is on: importing the API's stack in a new process
    costs ~4 s of CPU, and the suite starts dozens of them."""
    if prefork.enabled():
        return prefork.launch(command, child_env(), process_group=False)
    return spawn_bound(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_command(
    command: list[str], timeout: float, env: dict[str, str] | None = None, cwd: str | Path | None = None
) -> subprocess.CompletedProcess[str]:
    """subprocess.run(command, capture_output=True, text=True, ...): forked (see _start) when it is a `swarmlm`
    command line or a Python script and no other environment is asked for (another would need a forker of its
    own)."""
    if env is None and prefork.enabled() and prefork.can_fork(command):
        return prefork.run(command, child_env(), timeout, None if cwd is None else str(cwd))
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


@contextmanager
def http_server(
    args: list[str], ready_line: str, stopped_by_test: bool = True, output: list[str] | None = None
) -> Iterator[tuple[str, Process]]:
    """http_process(), yielding the process too, for a test that stops it itself (then it may have exited cleanly
    by the end)."""
    process = _start([*SWARMLM, *args])
    lines: list[str] = [] if output is None else output
    ready = threading.Event()
    url: list[str] = []

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if line.startswith(ready_line) and not ready.is_set():
                url.append(line[len(ready_line) :].strip())
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(0.2):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`swarmlm {args[0]}` did not start:\n{''.join(lines[-40:])}")
        yield url[0], process
        assert process.poll() in ((None, 0) if stopped_by_test else (None,)), (
            f"`swarmlm {args[0]}` died:\n{''.join(lines[-40:])}"
        )
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
