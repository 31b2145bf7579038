"""Bad input to any `swarmlm` command ends it with one line on stderr (no traceback), exit code 2 and no process left
running: wrong types, out-of-range values, malformed addresses, missing or unusable files, taken ports, dead peers.

Most cases are refused before anything heavy is imported (a fraction of a second each); the few that need the model,
the key parsers or the network are marked in CASES."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from swarmlm.swarm.dht import start_dht, visible_maddrs
from tests.addresses import dead_peer

SWARMLM = [sys.executable, "-m", "swarmlm.cli.main"]
# set in each run's environment: every process it starts (the DHT child, p2pd) inherits it, even once orphaned
RUN_TAG = "SWARMLM_TEST_RUN"
# what argparse and the commands print: "swarmlm: error: ..." or "swarmlm serve: error: ..."
ERROR_LINE = re.compile(r"^swarmlm( [a-z-]+)?: error: ")

# (case id, arguments with {placeholders} from the `places` fixture, words the error line must match)
SERVE = "serve {model} --blocks 0:2 --new-swarm"  # a valid start of a serve command
CASES = [
    # serve: ranges and types of its flags (argparse)
    ("serve-num-blocks-0", "serve {model} --num-blocks 0 --new-swarm",
     r"--num-blocks: must be an integer of 1 or more"),
    ("serve-blocks-reversed", "serve {model} --blocks 3:1 --new-swarm",
     r"--blocks 3:1: need 0 <= START < END"),
    ("serve-blocks-not-numbers", "serve {model} --blocks two --new-swarm",
     r"--blocks takes START:END"),
    ("serve-size-0", SERVE + " --max-tokens-per-request 0",
     r"--max-tokens-per-request: must be an integer of 1 or more, not '0'"),
    ("serve-size-wrong-type", SERVE + " --max-sessions many",
     r"--max-sessions: must be an integer of 1 or more, not 'many'"),
    ("serve-threads-negative", SERVE + " --num-threads -2",
     r"--num-threads: must be an integer of 1 or more"),
    ("serve-timeout-negative", SERVE + " --alloc-timeout -1",
     r"--alloc-timeout: must be a number of 0 or more, not '-1'"),
    ("serve-timeout-0", SERVE + " --write-timeout 0",
     r"--write-timeout: must be a number above 0"),
    ("serve-timeout-nan", SERVE + " --session-idle-timeout nan",
     r"--session-idle-timeout: must be a number above 0, not 'nan'"),
    ("serve-wait-negative", SERVE + " --decode-wait-ms -5",
     r"--decode-wait-ms: must be a number of 0 or more"),
    ("serve-share-above-1", SERVE + " --peer-cache-share 1.5",
     r"--peer-cache-share: must be a number above 0 up to 1"),
    ("serve-frame-0", SERVE + " --max-frame-mb 0",
     r"--max-frame-mb: must be a number above 0"),
    ("serve-port-too-big", SERVE + " --port 70000",
     r"--port: must be an integer from 0 up to 65535"),
    ("serve-dtype-unknown", SERVE + " --dtype float99",
     r"--dtype: invalid choice: 'float99'"),
    ("serve-record-ttl-short", SERVE + " --record-ttl 5 --announce-interval 10",
     r"--record-ttl \(5 s\) must be longer than --announce-interval \(10 s\)"),
    # serve: addresses, ports, files
    ("serve-peers-garbage", "serve {model} --blocks 0:2 --initial-peers garbage",
     r"--initial-peers: 'garbage' is not a peer's multiaddr \(it must begin with /\)"),
    ("serve-peers-no-peer-id", "serve {model} --blocks 0:2 --initial-peers /ip4/127.0.0.1/tcp/31337",
     r"--initial-peers: .* must end with /p2p/ and the peer's id"),
    ("serve-peers-bad-peer-id", "serve {model} --blocks 0:2 --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/xyz",
     r"'xyz' is not a peer id"),
    ("serve-host-name", SERVE + " --host localhost",
     r"--host must be an IP address .* not 'localhost'"),
    ("serve-host-not-here", SERVE + " --host 203.0.113.7",
     r"--host 203.0.113.7: not an address of this machine"),
    ("serve-p2p-port-taken", SERVE + " --host 127.0.0.1 --port {p2p_port}",
     r"--port {p2p_port}: the port is already in use on 127.0.0.1"),
    ("serve-p2p-port-taken-all-interfaces", SERVE + " --port {p2p_port}",
     r"--port {p2p_port}: the port is already in use on 0.0.0.0"),
    ("serve-swarm-key-missing", SERVE + " --swarm-key {missing}",
     r"--swarm-key {missing}: no such file"),
    ("serve-swarm-key-folder", SERVE + " --swarm-key {folder}",
     r"--swarm-key {folder}: not a file"),
    ("serve-adapter-missing", SERVE + " --adapters {missing}",
     r"--adapters {missing}: no such folder"),
    ("serve-adapter-not-peft", SERVE + " --adapters {folder}",
     r"--adapters {folder}: no adapter_config.json there"),
    ("serve-identity-folder", SERVE + " --identity {folder}",
     r"--identity {folder} is not a regular file"),
    ("serve-identity-under-a-file", SERVE + " --identity {file}/server.key",
     r"--identity .*: a part of the path is a file"),
    ("serve-identity-readable-by-others", SERVE + " --identity {open_key}",
     r"--identity {open_key} is accessible by others \(mode 0o644\); chmod 600 {open_key}"),
    ("serve-model-missing", "serve {missing} --blocks 0:1 --new-swarm",
     r"model {missing}: no such file or folder"),
    # serve: needs the model's config (a few seconds)
    ("serve-blocks-past-layers", "serve {model} --blocks 0:9 --new-swarm --host 127.0.0.1",
     r"--blocks 0:9 is outside the model's blocks 0:5"),
    # dht
    ("dht-peers-garbage", "dht --initial-peers garbage",
     r"--initial-peers: 'garbage' is not a peer's multiaddr"),
    ("dht-port-negative", "dht --port -1",
     r"--port: must be an integer from 0 up to 65535, not '-1'"),
    ("dht-p2p-port-taken", "dht --host 127.0.0.1 --port {p2p_port}",
     r"--port {p2p_port}: the port is already in use"),
    ("dht-swarm-key-garbage", "dht --host 127.0.0.1 --swarm-key {garbage_key}",
     r"{garbage_key} is not a swarm key"),
    ("dht-peers-unreachable", "dht --host 127.0.0.1 --initial-peers {dead_peer}",
     r"none of the initial peers answered .*Check that they are running"),
    # swarm-key
    ("swarm-key-file-exists", "swarm-key {file}",
     r"cannot write a swarm key to {file}: .*File exists"),
    # demo
    ("demo-model-unknown-name", "demo nosuchmodel",
     r"model nosuchmodel: not a known model name \(smollm2-135m-instruct\)"),
    ("demo-swarm-key-missing", "demo --swarm-key {missing}",
     r"--swarm-key {missing}: no such file"),
    ("demo-servers-0", "demo --servers 0",
     r"--servers: must be an integer of 1 or more"),
    ("demo-max-new-tokens-0", "demo --max-new-tokens 0",
     r"--max-new-tokens: must be an integer of 1 or more"),
    ("demo-api-port-too-big", "demo --api --api-port 99999",
     r"--api-port: must be an integer from 0 up to 65535"),
    ("demo-api-port-taken", "demo --api --api-port {http_port}",
     r"--api-port {http_port}: the port is already in use on 127.0.0.1"),
    # train
    ("train-swarm-key-missing", "train --swarm-key {missing}",
     r"--swarm-key {missing}: no such file"),
    ("train-steps-0", "train --steps 0",
     r"--steps: must be an integer of 1 or more"),
    ("train-lr-negative", "train --lr -0.1",
     r"--lr: must be a number above 0, not '-0.1'"),
    ("train-lora-rank-0", "train --tuning-mode lora --lora-rank 0",
     r"--lora-rank: must be an integer of 1 or more"),
    ("train-mode-unknown", "train --tuning-mode full",
     r"--tuning-mode: invalid choice: 'full'"),
    ("train-save-onto-a-file", "train --save {file}",
     r"--save {file}: a file is there; name a folder"),
    ("train-peers-garbage", "train --initial-peers garbage",
     r"--initial-peers: 'garbage' is not a peer's multiaddr"),
    ("train-model-missing", "train --model {missing}.gguf",
     r"model {missing}.gguf: no such file or folder"),
    # api, monitor, status
    ("api-peers-missing", "api {model}",
     r"the following arguments are required: --initial-peers"),
    ("api-model-missing", "api {missing} --initial-peers {dead_peer}",
     r"model {missing}: no such file or folder"),
    ("api-model-unknown-name", "api smollm3 --initial-peers {dead_peer}",
     r"model smollm3: not a known model name"),
    ("api-swarm-key-folder", "api {model} --initial-peers {dead_peer} --swarm-key {folder}",
     r"--swarm-key {folder}: not a file"),
    ("api-key-empty", "api {model} --initial-peers {dead_peer} --api-key=",
     r"--api-key: empty"),
    ("api-peers-garbage", "api {model} --initial-peers garbage",
     r"--initial-peers: 'garbage' is not a peer's multiaddr"),
    ("api-port-taken", "api {model} --initial-peers {dead_peer} --port {http_port}",
     r"--port {http_port}: the port is already in use on 127.0.0.1"),
    ("api-host-not-here", "api {model} --initial-peers {dead_peer} --host 203.0.113.7",
     r"--host 203.0.113.7: not an address of this machine"),
    ("api-concurrency-0", "api {model} --initial-peers {dead_peer} --max-concurrent 0",
     r"--max-concurrent: must be an integer of 1 or more"),
    ("api-timeout-negative", "api {model} --initial-peers {dead_peer} --missing-blocks-timeout -3",
     r"--missing-blocks-timeout: must be a number of 0 or more"),
    ("monitor-peers-garbage", "monitor --initial-peers garbage",
     r"--initial-peers: 'garbage' is not a peer's multiaddr"),
    ("monitor-port-taken", "monitor --initial-peers {dead_peer} --port {http_port}",
     r"--port {http_port}: the port is already in use"),
    ("monitor-swarm-key-missing", "monitor --initial-peers {dead_peer} --swarm-key {missing}",
     r"--swarm-key {missing}: no such file"),
    ("status-swarm-key-missing", "status --initial-peers {dead_peer} --swarm-key {missing}",
     r"--swarm-key {missing}: no such file"),
    ("status-swarm-key-garbage", "status --initial-peers {dead_peer} --swarm-key {garbage_key}",
     r"{garbage_key} is not a swarm key"),
    ("status-peers-garbage", "status --initial-peers garbage",
     r"--initial-peers: 'garbage' is not a peer's multiaddr"),
    ("status-peers-no-peer-id", "status --initial-peers /ip4/127.0.0.1/tcp/31337",
     r"must end with /p2p/ and the peer's id"),
    # simulate
    ("simulate-servers-0", "simulate --servers 0 --out {folder}",
     r"--servers: must be an integer of 1 or more, not '0'"),
    ("simulate-hours-negative", "simulate --hours -1 --out {folder}",
     r"--hours: must be a number above 0, not '-1'"),
    ("simulate-out-under-a-file", "simulate --hours 0.01 --servers 2 --clients 1 --out {file}/report",
     r"--out {file}/report: cannot create the folder"),
]  # fmt: skip


@pytest.fixture(scope="module")
def places(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The placeholders of CASES: the tiny model, files of each kind, a port a real p2pd listens on, a port an HTTP
    server would hold, and a peer nobody answers for."""
    root = tmp_path_factory.mktemp("cli-errors")
    (root / "folder").mkdir()
    (root / "file").write_text("not a key\n")
    garbage_key = root / "garbage.key"
    garbage_key.write_text("not a key\n")
    garbage_key.chmod(0o600)
    open_key = root / "open.key"
    open_key.write_bytes(b"\x00" * 68)
    open_key.chmod(0o644)
    node = start_dht(host="127.0.0.1", nat_traversal=False)  # p2pd binds its port with SO_REUSEPORT
    http = socket.create_server(("127.0.0.1", 0))  # as aiohttp binds: SO_REUSEADDR, no SO_REUSEPORT
    try:
        yield {
            "model": str(tiny_model_dir), "missing": str(root / "missing"), "folder": str(root / "folder"),
            "file": str(root / "file"), "garbage_key": str(garbage_key), "open_key": str(open_key),
            "p2p_port": visible_maddrs(node)[0].split("/")[4], "http_port": str(http.getsockname()[1]),
            "dead_peer": dead_peer(),
        }  # fmt: skip
    finally:
        http.close()
        node.shutdown()


def run_tagged(args: list[str]) -> tuple[subprocess.CompletedProcess, list[psutil.Process]]:
    """Run `swarmlm args`; its result and the processes it started that are still running a while after it ended."""
    tag = uuid.uuid4().hex
    result = subprocess.run(
        [*SWARMLM, *args], capture_output=True, text=True, timeout=300, env={**os.environ, RUN_TAG: tag}
    )
    _, alive = psutil.wait_procs(_tagged(tag), timeout=10)
    for process in alive:  # fail, but leave nothing to the next tests
        process.kill()
    return result, alive


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(RUN_TAG) == tag and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # gone meanwhile, or another user's
    return found


@pytest.mark.parametrize(("args", "expected"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_ends_the_command_with_one_line(args: str, expected: str, places: dict[str, str]) -> None:
    result, left = run_tagged([arg.format(**places) for arg in args.split()])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    # the error is the last line, and the only one (log lines of what ran before it may precede it)
    assert lines and ERROR_LINE.match(lines[-1]), result.stderr[-3000:]
    assert [line for line in lines if ": error: " in line] == [lines[-1]], result.stderr[-3000:]
    assert re.search(expected.format(**{k: re.escape(v) for k, v in places.items()}), lines[-1]), lines[-1]
    assert left == [], f"processes left running: {[p.name() for p in left]}"


def test_every_command_has_a_case() -> None:
    from swarmlm.cli.main import build_parser

    commands = {case[1].split()[0] for case in CASES}
    subparsers = next(action for action in build_parser()._actions if action.dest == "command")
    assert commands == set(subparsers.choices)
