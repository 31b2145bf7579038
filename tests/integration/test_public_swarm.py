"""Attacks that cost a stranger almost nothing, against a real server: each is bounded in the server's resident memory
(not only in its own ledgers), and an honest client is served, exactly, while and after it runs.

Hosts are loopback addresses: a p2pd listening on 127.0.0.x dials from it, so the server sees several hosts.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from swarmlm.client.loop import LoopThread
from swarmlm.protocol import service
from swarmlm.protocol.codec import encode, read_message
from swarmlm.protocol.messages import ForwardRequest, ReplyHeader
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm
from tests.integration.test_fair_hosts import rss_mb, server_maddrs

ACTIVATION_CACHE_MB = 160  # so a host may keep 80 MB of graphs
KEEP_ROWS, KEEP_SEQ = 16, 256  # a 4,096-token training forward: ~63 MB of graphs over the tiny model's 5 blocks
KEEPS_PER_PEER = 6  # so each peer alone sends ~380 MB of graphs that no backward ever takes
# resident memory a server may hold beyond its activation cache's budget while (and after) graphs are kept: the
# request being computed (its own graphs, before they are cached), its received bytes and the allocator's slack
MARGIN_MB = 150
P2PD_START_S = 60.0


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    extra_args = ["--activation-cache-mb", str(ACTIVATION_CACHE_MB), "--max-tokens-per-request", "8192"]
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

    async def _forward(self, p2p: P2P, header: ForwardRequest, hidden: torch.Tensor) -> ReplyHeader | None:
        async def parts():  # noqa: ANN202 - an async generator of request parts
            for part in encode(header, [hidden], runtime_pb2.ExpertRequest):
                yield part

        replies = await service.stub(p2p, self.server).rpc_forward(parts())
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
