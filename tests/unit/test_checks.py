"""Checks of option values, addresses, ports and files: what they accept, and errors that name the option; client
options and from_pretrained's own are refused before anything is loaded or started."""

from __future__ import annotations

import math
import socket
from dataclasses import fields
from pathlib import Path

import pytest

from swarmlm.checks import (
    FRACTION,
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    POSITIVE_INT,
    Range,
    check_can_listen,
    check_device,
    check_peer_maddrs,
    check_private_file,
)
from swarmlm.config import CLIENT_CHECKS, ClientConfig
from swarmlm.errors import ConfigError, ModelLoadError, SwarmError
from tests.conftest import descendants

ED25519_PEER = "12D3KooWMXNDkRPaPBHyHHeCwqF91EdkxJcfZqDsSYWUxGwR7Rga"
RSA_PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


@pytest.mark.parametrize(
    ("allowed", "good", "bad", "described"),
    [
        (POSITIVE_INT, [1, 10**9], [0, -1, 1.0, True, "3", None], "an integer of 1 or more"),
        (POSITIVE, [1e-9, 3, 2.5], [0, -0.1, math.nan, math.inf, False], "a number above 0"),
        (NON_NEGATIVE, [0, 0.0, 7], [-1e-9, math.nan, -math.inf], "a number of 0 or more"),
        (FRACTION, [1, 0.5, 1e-6], [0, 1.01], "a number above 0 up to 1"),
        (PORT, [0, 65535], [-1, 65536, 80.0], "an integer from 0 up to 65535"),
    ],
)
def test_a_range_accepts_its_numbers_only(allowed: Range, good: list, bad: list, described: str) -> None:
    assert all(allowed.accepts(value) for value in good)
    assert not any(allowed.accepts(value) for value in bad)
    assert allowed.describe() == described


def test_peer_multiaddrs_need_a_leading_slash_and_a_peer_id() -> None:
    check_peer_maddrs([f"/ip4/127.0.0.1/tcp/31337/p2p/{ED25519_PEER}", f"/dns4/example.org/tcp/1/p2p/{RSA_PEER}",
                       f"/ip4/1.2.3.4/tcp/1/p2p/{RSA_PEER}/p2p-circuit/p2p/{ED25519_PEER}"], "peers")  # fmt: skip
    for maddr, reason in [
        ("garbage", "it must begin with /"),
        ("/ip4/127.0.0.1/tcp/31337", "it must end with /p2p/"),
        (f"/ip4/127.0.0.1/tcp/31337/p2p/{ED25519_PEER}/", "it must end with /p2p/"),
        ("/ip4/127.0.0.1/tcp/31337/p2p/12D3KooW0OIl", "is not a peer id"),  # 0, O, I, l are not base58
        (f"/ip4/127.0.0.1/tcp/31337/p2p/{ED25519_PEER[:-3]}", "is not a peer id"),  # a digest cut short
    ]:
        with pytest.raises(ConfigError, match=rf"peers: .* is not a peer's multiaddr \(.*{reason}"):
            check_peer_maddrs([maddr], "peers")
    with pytest.raises(ConfigError, match="a list of multiaddrs, not one string"):
        check_peer_maddrs(f"/ip4/127.0.0.1/tcp/1/p2p/{ED25519_PEER}", "peers")


def test_a_port_someone_listens_on_is_refused_even_with_so_reuseport() -> None:
    # p2pd listens with SO_REUSEPORT, and another p2pd would bind beside it: the check must refuse the port anyway
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        for host in ("127.0.0.1", "0.0.0.0"):
            with pytest.raises(SwarmError, match=f"--port {port}: the port is already in use on {host}"):
                check_can_listen(host, port)
    check_can_listen("127.0.0.1", port)  # free again


def test_a_port_whose_last_connections_wait_in_time_wait_is_free() -> None:
    """A server restarted on its port finds the connections it closed in TIME_WAIT there: that is no conflict."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the side that closes first keeps the port in TIME_WAIT
    listener.close()
    check_can_listen("127.0.0.1", port)
    client.close()


def test_hosts_that_are_not_this_machine_are_refused() -> None:
    with pytest.raises(SwarmError, match="--host 203.0.113.7: not an address of this machine"):
        check_can_listen("203.0.113.7", 0)
    with pytest.raises(SwarmError, match="--bind no.such.host.invalid: not an address of this machine"):
        check_can_listen("no.such.host.invalid", 0, host_flag="--bind")


def test_key_files_must_be_private_regular_files(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("secret")
    key.chmod(0o600)
    check_private_file(key, "--identity")
    key.chmod(0o640)
    with pytest.raises(ConfigError, match=r"--identity .*key is accessible by others \(mode 0o640\); chmod 600"):
        check_private_file(key, "--identity")
    with pytest.raises(ConfigError, match="is not a regular file"):
        check_private_file(tmp_path, "--identity")


def test_devices_torch_does_not_know_or_this_machine_lacks_are_refused() -> None:
    check_device("cpu")
    with pytest.raises(ConfigError, match="'gpu' is not a torch device"):
        check_device("gpu")
    with pytest.raises(ConfigError, match="--device cuda:99: "):  # no CUDA here, or fewer devices than that
        check_device("cuda:99")


def test_every_client_check_is_for_a_client_option() -> None:
    assert set(CLIENT_CHECKS) <= {field.name for field in fields(ClientConfig)}
    ClientConfig()  # the defaults pass


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(request_timeout_s=-1.0), "request_timeout_s must be a number above 0, not -1.0"),
        (dict(request_timeout_s="60"), "request_timeout_s must be a number above 0, not '60'"),
        (dict(max_tokens_per_request=0), "max_tokens_per_request must be an integer of 1 or more"),
        (dict(max_retries=2.5), "max_retries must be an integer of 0 or more"),
        (dict(liveness_check_s=math.nan), "liveness_check_s must be a number of 0 or more"),
        (dict(verify_probability=1.5), "verify_probability must be a number from 0 up to 1"),
        (dict(accepted_dtypes="float32"), "accepted_dtypes must be a list of strings, not 'float32'"),
        (dict(accepted_dtypes=("fp16",)), "accepted_dtypes must name some of float32, bfloat16, float16"),
        (dict(accepted_dtypes=()), "accepted_dtypes must name some of"),
        (dict(allowed_servers=ED25519_PEER), "allowed_servers must be a list of strings"),
        (dict(blocked_servers=[1]), "blocked_servers must hold strings only"),
        (dict(use_push="no"), "use_push must be True or False"),
        (dict(wire_dtype="fp8"), "wire_dtype must be one of float32, bfloat16, float16, int8"),
        (dict(routing="fastest"), "routing must be one of auto, latency, throughput, not 'fastest'"),
        (dict(swarm_key=b"short"), "swarm_key must be .* 32-byte secret, not 5 bytes"),
        (dict(initial_peers=("garbage",)), "initial_peers: 'garbage' is not a peer's multiaddr"),
        (dict(dht_prefix=7), "dht_prefix must be a string or None"),
    ],
)
def test_client_options_out_of_range_or_of_the_wrong_type_are_refused(options: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ClientConfig(**options)


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [
        (dict(initial_peers=f"/ip4/127.0.0.1/tcp/1/p2p/{ED25519_PEER}"), ConfigError, "a list of multiaddrs"),
        (dict(initial_peers=[]), ConfigError, "initial_peers is empty"),
        (dict(initial_peers=["garbage"]), ConfigError, "initial_peers: 'garbage' is not a peer's multiaddr"),
        (dict(request_timeout_s=0), ConfigError, "request_timeout_s must be a number above 0"),
        (dict(swarm_key="/no/such/swarm.key"), SwarmError, "cannot read the swarm key /no/such/swarm.key"),
        (dict(tuning_mode="full"), ConfigError, "tuning_mode must be None, 'ptune', 'deep_ptune' or 'lora'"),
        (dict(tuning_mode="ptune", pre_seq_len=0), ConfigError, "pre_seq_len must be an integer of 1 or more"),
        (dict(tuning_mode="lora", lora_rank=-4), ConfigError, "lora_rank must be an integer of 1 or more"),
        (dict(tuning_mode="lora", lora_target_modules=["nope"]), ConfigError, r"lora_target_modules \['nope'\]"),
    ],
)
def test_from_pretrained_refuses_bad_options_before_it_starts_anything(
    tiny_model_dir: Path, options: dict, error: type[Exception], named: str
) -> None:
    from swarmlm import AutoDistributedModelForCausalLM

    options.setdefault("initial_peers", [f"/ip4/127.0.0.1/tcp/1/p2p/{ED25519_PEER}"])
    before = {process.pid for process in descendants()}  # other tests' swarms (or forkers) may run meanwhile
    with pytest.raises(error, match=named):
        AutoDistributedModelForCausalLM.from_pretrained(tiny_model_dir, **options)
    assert {process.pid for process in descendants()} == before  # no DHT process, no p2pd


def test_from_pretrained_refuses_a_missing_model_before_it_starts_anything() -> None:
    from swarmlm import AutoDistributedModelForCausalLM

    before = {process.pid for process in descendants()}
    with pytest.raises(ModelLoadError, match="/no/such/model"):
        AutoDistributedModelForCausalLM.from_pretrained(
            "/no/such/model", initial_peers=[f"/ip4/127.0.0.1/tcp/1/p2p/{ED25519_PEER}"]
        )
    assert {process.pid for process in descendants()} == before


def test_an_identity_path_under_a_file_is_a_clear_error(tmp_path: Path) -> None:
    from swarmlm.swarm.keyfile import load_or_create_identity

    (tmp_path / "file").write_text("")
    with pytest.raises(SwarmError, match="identity .*file/server.key: cannot read or create it"):
        load_or_create_identity(tmp_path / "file" / "server.key")


def test_training_refuses_a_batch_larger_than_the_task_before_loading_the_model() -> None:
    from swarmlm.tools.train import TrainOptions, run_training

    with pytest.raises(ConfigError, match=r"--batch-size 100000: must be from 1 up to \d+"):
        run_training(TrainOptions(model="/no/such/model", batch_size=100_000))
