"""The `swarmlm` command: a bootstrap node others join (also one that comes up late), and clear errors for bad
arguments."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import PeerID

from swarmlm.errors import UnreachablePeersError
from swarmlm.swarm.dht import BOOTSTRAP_ATTEMPTS, BOOTSTRAP_RETRY_S, start_dht
from swarmlm.swarm.identity import peer_id_bytes
from swarmlm.tools.local_swarm import READY_LINE
from swarmlm.utils.processes import spawn_bound
from tests.conftest import LOGITS_ATOL, load_reference
from tests.integration.http_process import run_command

SWARMLM = [sys.executable, "-m", "swarmlm.cli.main"]


def test_bootstrap_node_serves_as_entry_point_for_a_new_swarm(tiny_model_dir: Path) -> None:
    from swarmlm import AutoDistributedModelForCausalLM

    dht = spawn_bound([*SWARMLM, "dht", "--host", "127.0.0.1"], stdout=subprocess.PIPE, text=True)
    server = None
    try:
        line = dht.stdout.readline()
        assert line.startswith("Others join with: --initial-peers /ip4/127.0.0.1/"), line
        peers = line.split("--initial-peers ", 1)[1].split()
        server = spawn_bound(
            [*SWARMLM, "serve", str(tiny_model_dir), "--blocks", "0:5", "--host", "127.0.0.1",
             "--num-threads", "1", "--initial-peers", *peers],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for line in server.stdout:
            if line.startswith(READY_LINE):
                break
        ids = torch.randint(0, 128, (1, 5))
        with AutoDistributedModelForCausalLM.from_pretrained(tiny_model_dir, initial_peers=peers) as model:
            logits = model(ids).logits
        with torch.inference_mode():
            assert (logits - load_reference(tiny_model_dir)(ids).logits).abs().max().item() <= LOGITS_ATOL
    finally:
        for process in (server, dht):
            if process is not None:
                process.send_signal(signal.SIGTERM)
                assert process.wait(30) == 0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return run_command([*SWARMLM, *args], timeout=120)


def test_bad_arguments_get_clear_errors(tiny_model_dir: Path) -> None:
    result = run_cli("serve", str(tiny_model_dir), "--blocks", "0:9", "--new-swarm")
    assert result.returncode == 2 and "outside the model's blocks 0:5" in result.stderr
    result = run_cli("serve", str(tiny_model_dir), "--blocks", "0:2")
    assert result.returncode == 2 and "--initial-peers" in result.stderr and "--new-swarm" in result.stderr
    result = run_cli("serve", str(tiny_model_dir), "--blocks", "two")
    assert result.returncode == 2 and "START:END" in result.stderr
    result = run_cli("serve", "/no/such/model", "--blocks", "0:1", "--new-swarm")
    assert result.returncode == 2 and "/no/such/model" in result.stderr


def test_bad_adapters_and_quantization_get_clear_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-adapter"
    missing.mkdir()
    result = run_cli("serve", str(tiny_model_dir), "--blocks", "0:2", "--new-swarm", "--adapters", str(missing))
    assert result.returncode == 2 and "adapter_config.json" in result.stderr
    adapter = tmp_path / "an-adapter"  # looks like one to the command line's early check; never read
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    for mode in ("int8", "nf4"):
        result = run_cli(
            "serve", str(tiny_model_dir), "--blocks", "0:2", "--new-swarm", "--quant", mode, "--adapters", str(adapter)
        )
        assert result.returncode == 2 and "cannot be combined" in result.stderr


def test_a_node_whose_initial_peer_starts_late_still_joins_and_one_that_never_does_gives_up() -> None:
    key = Ed25519PrivateKey.generate()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    bootstrap = f"/ip4/127.0.0.1/tcp/{port}/p2p/{PeerID(peer_id_bytes(key)).to_base58()}"
    began = time.monotonic()
    with pytest.raises(UnreachablePeersError, match="none of the initial peers answered"):  # a few tries, then this
        start_dht([bootstrap], host="127.0.0.1")
    waits = sum(BOOTSTRAP_RETRY_S * attempt for attempt in range(1, BOOTSTRAP_ATTEMPTS))
    assert waits <= time.monotonic() - began < waits + 20
    joined: list = []
    joiner = threading.Thread(target=lambda: joined.append(start_dht([bootstrap], host="127.0.0.1")))
    joiner.start()
    time.sleep(0.5)  # its first try finds nobody
    node = start_dht(host="127.0.0.1", port=port, key=key)  # the initial peer comes up
    try:
        joiner.join(60)
        assert joined, "the node did not start once its initial peer was up"
        assert str(node.peer_id) in {str(peer) for peer in joined[0].run_coroutine(_peers)}
    finally:
        node.shutdown()
        for dht in joined:
            dht.shutdown()


async def _peers(dht, node) -> list:  # hivemind's run_coroutine signature
    return [info.peer_id for info in await node.p2p.list_peers()]


def test_version_is_printed_and_an_unknown_model_is_refused_before_heavy_imports() -> None:
    from swarmlm.version import __version__

    result = subprocess.run([*SWARMLM, "--version"], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, f"swarmlm {__version__}")
    peer = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWEEnaRWUL7SnGHtc79b3cq6voP7qDJkJ2mBbBYXRPaafs"
    for args in (["api", "smollm3", "--initial-peers", peer], ["demo", "--model", "no-such-model"]):
        began = time.perf_counter()
        result = subprocess.run([*SWARMLM, *args], capture_output=True, text=True, timeout=60)
        took = time.perf_counter() - began
        assert result.returncode == 2 and "not a known model name" in result.stderr, result.stderr
        print(f"\n{' '.join(args[:2])} refused in {took:.2f} s")
        assert took < 1.5  # the interpreter's start and the CLI's parser only: no torch, no transformers
