"""A server's life: load its span, join the swarm, announce itself, serve until told to stop, leave cleanly."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import hivemind
import torch

from swarmlm import __version__
from swarmlm.config import ServerConfig
from swarmlm.errors import SwarmError
from swarmlm.models.fingerprint import model_fingerprint
from swarmlm.models.loading import load_config, resolve_model
from swarmlm.models.naming import default_dht_prefix
from swarmlm.models.span import SpanModel
from swarmlm.protocol import service
from swarmlm.protocol.messages import ServerInfo
from swarmlm.server import transport
from swarmlm.server.backend import SpanBackend
from swarmlm.server.cache import CacheBudget, default_cache_tokens
from swarmlm.server.handler import SpanHandler
from swarmlm.server.inference import InferenceSessions
from swarmlm.server.peers import PeerLedger, PeerLimits
from swarmlm.server.transport import StreamLimits
from swarmlm.server.validation import max_message_bytes
from swarmlm.swarm.dht import start_dht, visible_maddrs
from swarmlm.swarm.records import ServerRecord, ServerState, announce

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Server:
    """Serves blocks [start_block, end_block) of one model; `run()` blocks until SIGINT/SIGTERM."""

    def __init__(self, config: ServerConfig):
        self.config = config
        if config.dtype not in DTYPES:
            raise SwarmError(f"--dtype must be one of {', '.join(DTYPES)}, not {config.dtype!r}")
        if not config.new_swarm and not config.initial_peers:
            raise SwarmError("give --initial-peers to join a swarm, or --new-swarm to start one")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dht_prefix = config.dht_prefix or default_dht_prefix(config.model)
        model_dir = resolve_model(config.model, cache_dir=config.cache_dir)
        num_blocks = load_config(model_dir).num_hidden_layers
        # clients use only servers of the very model they loaded: announced in every record
        self.fingerprint = model_fingerprint(model_dir)
        if not 0 <= config.start_block < config.end_block <= num_blocks:
            raise SwarmError(
                f"--blocks {config.start_block}:{config.end_block} is outside the model's blocks 0:{num_blocks}"
            )
        logger.info("Loading blocks %d:%d of %s", config.start_block, config.end_block, model_dir)
        span = SpanModel.from_dir(model_dir, config.start_block, config.end_block, DTYPES[config.dtype], config.device)
        self.backend = SpanBackend(span, DTYPES[config.dtype], config.device, config.max_tokens_per_request)
        self.throughput = self.backend.measure_throughput()
        self.inference_throughput = self.backend.measure_inference_throughput()
        span_config = span.config
        request_bytes = max_message_bytes(config.max_tokens_per_request, span_config.hidden_size)
        self.peer_memory_bytes = int(config.peer_memory_mb * 1e6) if config.peer_memory_mb else 4 * request_bytes
        self.cache_tokens = config.cache_tokens or default_cache_tokens(
            span_config, config.end_block - config.start_block, DTYPES[config.dtype], config.device,
            reserved_bytes=self.peer_memory_bytes,
        )  # fmt: skip
        self.dht: hivemind.DHT | None = None
        self.budget: CacheBudget | None = None  # made on the server's event loop, in _serve
        self.inference: InferenceSessions | None = None

    def run(self) -> None:
        self.dht = start_dht(
            () if self.config.new_swarm else self.config.initial_peers, host=self.config.host, port=self.config.port
        )
        try:
            asyncio.run(self._serve())
        finally:
            self.backend.shutdown()
            self.dht.shutdown()
            logger.info("Server stopped")

    def _record(self, state: ServerState, addrs: list[str]) -> ServerRecord:
        return ServerRecord(
            state=state,
            start=self.config.start_block,
            end=self.config.end_block,
            throughput=self.throughput,
            dtype=self.config.dtype,
            addrs=tuple(addrs),
            fingerprint=self.fingerprint,
            version=__version__,
            max_tokens_per_request=self.config.max_tokens_per_request,
            cache_tokens_total=self.cache_tokens,
            cache_tokens_left=self._cache_tokens_left(),
            inference_throughput=self.inference_throughput,
            sessions_open=0 if self.inference is None else self.inference.open_sessions,
        )

    def _cache_tokens_left(self) -> int:
        budget = self.budget
        return self.cache_tokens if budget is None else max(0, budget.capacity - budget.used)

    def describe(self) -> ServerInfo:
        """This server now, as rpc_info answers it."""
        cfg, limits = self.config, self.backend.limits
        return ServerInfo(
            start_block=cfg.start_block,
            end_block=cfg.end_block,
            version=__version__,
            fingerprint=self.fingerprint,
            dtype=cfg.dtype,
            max_tokens_per_request=limits.max_tokens,
            max_position=limits.max_position,
            cache_tokens_total=self.cache_tokens,
            cache_tokens_left=self._cache_tokens_left(),
            sessions_open=0 if self.inference is None else self.inference.open_sessions,
            throughput=self.throughput,
            inference_throughput=self.inference_throughput,
        )

    async def _serve(self) -> None:
        if self.dht is None:
            raise RuntimeError("the server's DHT is started by run()")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        p2p = await self.dht.replicate_p2p()
        cfg = self.config
        ledger = PeerLedger(PeerLimits(self.peer_memory_bytes, cfg.max_sessions_per_peer, cfg.max_sessions,
                                       cfg.peer_cache_share))  # fmt: skip
        self.budget = CacheBudget(self.cache_tokens)
        self.inference = inference = InferenceSessions(
            self.backend,
            self.budget,
            ledger,
            alloc_timeout_s=self.config.alloc_timeout_s,
            idle_timeout_s=self.config.session_idle_timeout_s,
            chunk_tokens=self.config.inference_chunk_tokens,
        )
        servicer = SpanHandler(self.backend, inference, self.config.request_timeout_s, self.describe)
        limits = StreamLimits(int(cfg.max_frame_mb * 1e6), cfg.request_timeout_s, cfg.write_timeout_s)
        await transport.register(p2p, servicer, ledger, limits)
        peer_id, addrs = p2p.peer_id.to_base58(), visible_maddrs(self.dht)
        await announce(self.dht, self.dht_prefix, peer_id, self._record(ServerState.ONLINE, addrs), cfg.record_ttl_s)
        print(
            f"Serving blocks {cfg.start_block}:{cfg.end_block} of {cfg.model} as swarm {self.dht_prefix!r}, "
            f"{self.throughput:.0f} tokens/s per block",
            flush=True,
        )
        print("Others join with: --initial-peers " + " ".join(addrs), flush=True)
        print(f"Server ready: peer {peer_id}", flush=True)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=cfg.announce_interval_s)
            except TimeoutError:
                record = self._record(ServerState.ONLINE, addrs)
                if not await announce(self.dht, self.dht_prefix, peer_id, record, cfg.record_ttl_s):
                    logger.warning("Refreshing the DHT record failed; retrying in %.0f s", cfg.announce_interval_s)
        logger.info("Shutting down: announcing offline (served %d requests)", servicer.served)
        offline = self._record(ServerState.OFFLINE, addrs)
        # the DHT keeps the record that expires last, so the offline one must not expire before the online one
        await announce(self.dht, self.dht_prefix, peer_id, offline, cfg.record_ttl_s)
        await service.unregister(p2p)
        await p2p.shutdown()
        sys.stdout.flush()
