"""Attacks that cost a stranger almost nothing, against a real server: each is bounded in the server's resident memory
(not only in its own ledgers), and an honest client is served, exactly, while and after it runs.

Hosts are loopback addresses: a p2pd listening on 127.0.0.x dials from it, so the server sees several hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import base58
import hivemind
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarmlm.api.monitor import Monitor
from swarmlm.client.loop import LoopThread
from swarmlm.models.naming import model_name
from swarmlm.protocol import service
from swarmlm.protocol.codec import encode, read_message
from swarmlm.protocol.messages import BackwardRequest, ForwardRequest, ReplyHeader
from swarmlm.swarm.identity import SIGNATURE_MARK, PeerIdSignatureValidator, _signed_bytes, peer_id_bytes
from swarmlm.swarm.records import servers_key
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm
from tests.integration.test_fair_hosts import rss_mb, server_maddrs
from tests.integration.test_routing_modes import add_rated

ACTIVATION_CACHE_MB = 160  # so a host may keep 80 MB of graphs
KEEP_ROWS, KEEP_SEQ = 16, 256  # a 4,096-token training forward: ~63 MB of graphs over the tiny model's 5 blocks
KEEPS_PER_PEER = 6  # so each peer alone sends ~380 MB of graphs that no backward ever takes
# resident memory a server may hold beyond its activation cache's budget while (and after) graphs are kept: the
# request being computed (its own graphs, before they are cached), its received bytes and the allocator's slack
MARGIN_MB = 150
P2PD_START_S = 60.0
STREAMS_PER_PEER = 32  # the streams one peer may hold open (the default is one per session slot, 256, and 64 more)


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    extra_args = [
        "--activation-cache-mb", str(ACTIVATION_CACHE_MB), "--max-tokens-per-request", "8192",
        "--max-streams-per-peer", str(STREAMS_PER_PEER),
    ]  # fmt: skip
    with running_swarm(tiny_model_dir, [(0, 5)], extra_args=extra_args) as swarm:
        yield swarm


class Peers:
    """Peer ids (one p2pd each) on loopback hosts, sending requests to one server as a hostile client would."""

    def __init__(self, swarm: LocalSwarm, hosts: list[str]):
        self.server = PeerID.from_base58(swarm.servers[0].peer_id)
        self.loop = LoopThread()
        maddrs = server_maddrs(swarm)

        async def create(host: str) -> P2P:
            return await P2P.create(host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=maddrs, nat_port_map=False,
                                    auto_nat=False, use_relay=False, dht_mode="client",
                                    startup_timeout=P2PD_START_S)  # fmt: skip

        async def create_all() -> list[P2P]:
            return list(await asyncio.gather(*(create(host) for host in hosts)))

        self.p2ps = self.loop.run(create_all())

    async def _forward(self, p2p: P2P, header: ForwardRequest, *tensors: torch.Tensor) -> ReplyHeader | None:
        async def parts():  # an async generator of request parts
            for part in encode(header, tensors, runtime_pb2.ExpertRequest):
                yield part

        stub = service.stub(p2p, self.server)
        replies = await (stub.rpc_backward if isinstance(header, BackwardRequest) else stub.rpc_forward)(parts())
        message = await read_message(replies, ReplyHeader, max_bytes=1 << 28)
        return None if message is None else message[0]

    def keep_forwards(self, count: int, rows: int, seq: int) -> list[bool]:
        """Each peer sends `count` training forwards asking the server to keep their graphs, one after the other,
        and never the backward; whether each was answered."""
        hidden = torch.randn(rows, seq, 64)

        async def one_peer(p2p: P2P) -> list[bool]:
            answered = []
            for _ in range(count):
                header = ForwardRequest(start_block=0, end_block=5, keep=secrets.token_hex(16))
                reply = await asyncio.wait_for(self._forward(p2p, header, hidden), 120)
                answered.append(reply is not None and reply.ok)
            return answered

        async def all_peers() -> list[bool]:
            done = await asyncio.gather(*(one_peer(p2p) for p2p in self.p2ps))
            return [ok for each in done for ok in each]

        return self.loop.run(all_peers())

    def forwards(self, count: int, hidden: torch.Tensor, grad_outputs: torch.Tensor | None = None) -> list[bool]:
        """Each peer sends `count` forwards of `hidden` (backwards, with grad_outputs) at once (all peers together);
        whether each was answered (a refusal, or a stream the server cut, is not)."""

        if grad_outputs is None:
            header, tensors = ForwardRequest(start_block=0, end_block=5), [hidden]
        else:
            header = BackwardRequest(start_block=0, end_block=5, tensors=["hidden", "grad_outputs"])
            tensors = [hidden, grad_outputs]

        async def one(p2p: P2P) -> bool:
            try:
                reply = await asyncio.wait_for(self._forward(p2p, header, *tensors), 120)
            except (ConnectionError, asyncio.IncompleteReadError):
                return False  # cut off while it was sending or waiting
            return reply is not None and reply.ok

        async def all_peers() -> list[bool]:
            return list(await asyncio.gather(*(one(p2p) for p2p in self.p2ps for _ in range(count))))

        return self.loop.run(all_peers())

    def close(self) -> None:
        async def shutdown() -> None:
            await asyncio.gather(*(p2p.shutdown() for p2p in self.p2ps), return_exceptions=True)

        self.loop.run(shutdown())
        self.loop.close()


def honest_forward_is_exact(swarm: LocalSwarm, tiny_model_dir: Path) -> None:
    ids = torch.randint(0, 128, (2, 9))
    with torch.inference_mode():
        expected = load_reference(tiny_model_dir)(ids).logits
    with connected_model(tiny_model_dir, swarm) as model:
        assert (model(ids).logits - expected).abs().max().item() <= LOGITS_ATOL


@pytest.mark.parametrize("hosts", [["127.0.0.1"], ["127.0.0.2", "127.0.0.3", "127.0.0.4"]], ids=["one", "three"])
def test_training_forwards_whose_backward_never_comes_stay_within_the_activation_cache(
    swarm: LocalSwarm, tiny_model_dir: Path, hosts: list[str]
) -> None:
    pid = swarm.servers[0].process.pid
    before = rss_mb(pid)
    peers = Peers(swarm, hosts)
    try:
        peak = before
        for _ in range(KEEPS_PER_PEER):
            answered = peers.keep_forwards(1, KEEP_ROWS, KEEP_SEQ)
            assert all(answered)
            peak = max(peak, rss_mb(pid))
    finally:
        peers.close()
    time.sleep(1.0)
    after = rss_mb(pid)
    sent_mb = len(hosts) * KEEPS_PER_PEER * 63
    print(f"\n{len(hosts)} host(s) sent ~{sent_mb} MB of kept graphs: server RSS {before:.0f} MB before, "
          f"peak {peak:.0f}, {after:.0f} after")  # fmt: skip
    assert peak - before < ACTIVATION_CACHE_MB + MARGIN_MB
    assert after - before < ACTIVATION_CACHE_MB + MARGIN_MB
    honest_forward_is_exact(swarm, tiny_model_dir)


class ManyKeys(PeerIdSignatureValidator):
    """An attacker's validator holding many keys (they are free): each record is validly signed by the key of the
    peer id it is stored under."""

    def __init__(self, keys: list[Ed25519PrivateKey]):
        super().__init__(keys[0])
        self._seeds = {base58.b58encode(peer_id_bytes(key)).decode(): key.private_bytes(
            Encoding.Raw, PrivateFormat.Raw, NoEncryption()) for key in keys}  # fmt: skip

    def sign_value(self, record: DHTRecord) -> bytes:
        seed = self._seeds.get(MSGPackSerializer.loads(record.subkey))
        if seed is None:
            return record.value
        return record.value + SIGNATURE_MARK + Ed25519PrivateKey.from_private_bytes(seed).sign(_signed_bytes(record))


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A TCP port that takes connections and never says a word (a peer that answers slowly: forever)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for each in [listener, *held]:
            each.close()


def closed_port() -> int:
    """A TCP port nothing listens on (connections are refused at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


FAKE_KEYS = 13
FAKE_CLIENTS = 4  # fresh clients, each meeting every fake record for the first time


# what honest servers announce: a real model's speed on a CPU (the tiny model's own would make any claim look slow)
HONEST_TOKENS_PER_S = 2000.0


@pytest.fixture(scope="module")
def two_spans(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    with LocalSwarm(str(tiny_model_dir)) as swarm:
        swarm.wait_ready([add_rated(swarm, 0, 3, HONEST_TOKENS_PER_S), add_rated(swarm, 3, 5, HONEST_TOKENS_PER_S)])
        yield swarm


def store_fakes(swarm: LocalSwarm, key: str, keys: list[Ed25519PrivateKey], silent: int) -> hivemind.DHT:
    """Validly signed records of `keys`, each announcing blocks of the model at a speed no server has, at an
    address that refuses connections or (every other one) takes them and never answers."""
    honest = swarm.dht.get(key, latest=True).value
    template = next(iter(honest.values())).value
    attacker = hivemind.DHT(initial_peers=swarm.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                            record_validators=[ManyKeys(keys)], nat_port_map=False, auto_nat=False, use_relay=False,
                            use_auto_relay=False)  # fmt: skip
    for i, fake in enumerate(keys):
        peer = base58.b58encode(peer_id_bytes(fake)).decode()
        port = silent if i % 2 else closed_port()
        start, end = [(0, 5), (0, 3), (3, 5), (0, 1), (1, 5)][i % 5]
        record = {**template, "start": start, "end": end, "throughput": 1e9, "inference_throughput": 1e9,
                  "addrs": [f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer}"], "cache_tokens_left": 10**9,
                  "sessions_open": 0, "queue_depth": 0.0}  # fmt: skip
        assert attacker.store(key, record, get_dht_time() + 600, subkey=peer)
    assert len(swarm.dht.get(key, latest=True).value) >= len(honest) + len(keys)  # the swarm lists them all
    return attacker


@pytest.mark.parametrize("use_push", [True, False], ids=["push", "no-push"])
def test_fake_records_of_many_keys_never_make_a_client_give_up(
    two_spans: LocalSwarm, tiny_model_dir: Path, use_push: bool
) -> None:
    """Clients new to the swarm and one that measured the honest servers before the fakes came (exploring often,
    so it tries unmeasured servers) all succeed, exactly, every time, each fake costing them one short wait."""
    swarm = two_spans
    key = servers_key(swarm.dht_prefix or model_name(str(tiny_model_dir)).swarm)
    reference = load_reference(tiny_model_dir)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected_logits = reference(ids).logits
        expected_tokens = reference.generate(ids[:1], max_new_tokens=6, do_sample=False)

    def exact(model: torch.nn.Module) -> None:
        assert (model(ids).logits - expected_logits).abs().max().item() <= LOGITS_ATOL
        assert torch.equal(model.generate(ids[:1], max_new_tokens=6, do_sample=False), expected_tokens)

    with contextlib.ExitStack() as stack:
        options = dict(use_push=use_push, swarm_refresh_interval_s=0.5, explore_interval_s=0.5)
        veteran = stack.enter_context(connected_model(tiny_model_dir, swarm, **options))
        exact(veteran)
        silent = stack.enter_context(silent_port())
        attacker = store_fakes(swarm, key, [Ed25519PrivateKey.generate() for _ in range(FAKE_KEYS)], silent)
        stack.callback(attacker.shutdown)
        time.sleep(1.0)  # the veteran's view now holds the fakes
        assert len(veteran.model.layers.client.manager.servers) >= len(swarm.servers) + FAKE_KEYS
        for round in range(FAKE_CLIENTS):
            began = time.monotonic()
            with connected_model(tiny_model_dir, swarm, use_push=use_push) as model:
                exact(model)
            new_s = time.monotonic() - began
            began = time.monotonic()
            exact(veteran)
            time.sleep(0.5)  # a time to explore again
            print(f"\n{FAKE_KEYS} fake records, round {round}: a new client's forward and generation took "
                  f"{new_s:.1f} s, the veteran's {time.monotonic() - began:.1f} s")  # fmt: skip


def test_a_signed_record_beyond_the_models_blocks_is_not_listed(two_spans: LocalSwarm, tiny_model_dir: Path) -> None:
    """A record claiming blocks 0:9 of the 5-block model neither reaches a client's routes nor makes the swarm's
    status show blocks 5-8 missing."""
    swarm = two_spans
    key = servers_key(swarm.dht_prefix or model_name(str(tiny_model_dir)).swarm)
    liar = Ed25519PrivateKey.generate()
    peer = base58.b58encode(peer_id_bytes(liar)).decode()
    template = next(iter(swarm.dht.get(key, latest=True).value.values())).value
    attacker = hivemind.DHT(initial_peers=swarm.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                            record_validators=[ManyKeys([liar])], nat_port_map=False, auto_nat=False, use_relay=False,
                            use_auto_relay=False)  # fmt: skip
    loop = LoopThread()
    monitor = Monitor(swarm.dht)
    try:
        assert attacker.store(key, {**template, "start": 0, "end": 9}, get_dht_time() + 600, subkey=peer)
        assert peer in swarm.dht.get(key, latest=True).value  # valid as a record: signed by its owner
        (model,) = [m for m in loop.run(monitor.snapshot())["models"] if m["dht_prefix"] == key.rsplit(".", 1)[0]]
        assert model["num_blocks"] == 5 and model["complete"], model
        assert peer not in {row["peer_id"] for row in model["servers"]}
        with connected_model(tiny_model_dir, swarm) as client:
            assert peer not in client.model.layers.client.manager.servers
            assert set(client.model.layers.client.manager.servers) >= {server.peer_id for server in swarm.servers}
    finally:
        loop.run(monitor.close())
        loop.close()
        attacker.shutdown()


def test_a_peer_flooding_refused_streams_gets_one_log_line(swarm: LocalSwarm, tiny_model_dir: Path) -> None:
    """Streams past a peer's bound are refused, each costing the attacker one open; the log says so once per
    interval, not once per stream (every line a peer can cause is rate-limited)."""
    log = swarm.servers[0].log_path
    before = log.read_text().count("stream refused")
    peers = Peers(swarm, ["127.0.0.1"])
    writers: list[asyncio.StreamWriter] = []

    async def open_many(count: int) -> int:
        opened = 0
        for _ in range(count):
            try:
                _, _, writer = await peers.p2ps[0].call_binary_stream_handler(peers.server, "SpanService.rpc_forward")
            except Exception:  # noqa: BLE001 - refused streams may fail to open at all
                continue
            writer.write(P2P.MESSAGE_MARKER)  # a frame begun: the stream reaches the server (opens are lazy)
            writers.append(writer)
            opened += 1
        await asyncio.sleep(2.0)
        return opened

    try:
        peers.loop.run(open_many(10 * STREAMS_PER_PEER))
    finally:
        for writer in writers:
            writer.close()
        peers.close()
    refused = log.read_text().count("stream refused") - before
    print(f"\n{10 * STREAMS_PER_PEER} streams opened by one peer: {refused} 'stream refused' lines")
    assert 1 <= refused <= 2
    honest_forward_is_exact(swarm, tiny_model_dir)
