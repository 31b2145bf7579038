"""A server's life: join the swarm, claim and load its span, announce itself, serve, move, drain and leave."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

import hivemind
import torch
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time
from transformers import PretrainedConfig

from swarmlm.checks import check_device
from swarmlm.config import ServerConfig
from swarmlm.errors import SwarmError
from swarmlm.models.adapters import adapter_name, load_adapters
from swarmlm.models.fingerprint import model_fingerprint
from swarmlm.models.hub import evict
from swarmlm.models.loading import checkpoint_dtype, default_cache_dir, load_config, resolve_model, weight_files_for
from swarmlm.models.naming import model_name
from swarmlm.models.quant import QUANT_MODES, bnb_functional, module_bytes, quantize
from swarmlm.models.registry import get_family
from swarmlm.models.span import SpanModel
from swarmlm.net import transport
from swarmlm.net.transport import Gate, StreamLimits
from swarmlm.protocol.messages import ServerInfo
from swarmlm.server import activity, lifecycle, memory, speed
from swarmlm.server.activations import ActivationCache
from swarmlm.server.backend import SpanBackend
from swarmlm.server.cache import CacheBudget, default_cache_tokens
from swarmlm.server.handler import SpanHandler
from swarmlm.server.inference import InferenceSessions
from swarmlm.server.membership import Members, refuse_outsider
from swarmlm.server.peers import MEMORY_PEERS, PeerLedger, PeerLimits
from swarmlm.server.placement import Span, claimed_first, estimate_throughput, requested_span, should_move
from swarmlm.server.push import Pusher
from swarmlm.server.scheduler import BatchLimits
from swarmlm.server.validation import max_message_bytes
from swarmlm.swarm.catalog import CatalogEntry, announce_entry, catalog_key
from swarmlm.swarm.dht import check_announce_maddrs, check_relay_maddrs, relay_circuit, start_dht, visible_maddrs
from swarmlm.swarm.keyfile import load_or_create_identity
from swarmlm.swarm.private import blind_prefix
from swarmlm.swarm.reconnect import peers_file
from swarmlm.swarm.records import ServerRecord, ServerState, announce, fetch_servers
from swarmlm.version import __version__

logger = logging.getLogger(__name__)
# the modules that log each request, batch and inference step (at DEBUG; at INFO with --log-requests)
REQUEST_LOGGERS = ("swarmlm.server.backend", "swarmlm.server.handler", "swarmlm.server.inference")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_DTYPE = "auto"  # --dtype auto: compute in the checkpoint's own dtype


def serving_dtype(name: str, model_config: PretrainedConfig) -> str:
    """The compute dtype a server asked for `name` uses: `name` itself, or for "auto" the dtype the checkpoint's
    config.json names (float32 when it names none; a converted GGUF file names float32)."""
    if name != AUTO_DTYPE:
        return name
    own = checkpoint_dtype(model_config)
    for known, dtype in DTYPES.items():
        if dtype == own:
            return known
    raise SwarmError(f"the checkpoint's dtype {own} cannot be served: pass --dtype {', '.join(DTYPES)}")


class Server:
    """Serves a span of one model (given, or chosen where the swarm is weakest); `run()` returns after SIGTERM."""

    def __init__(self, config: ServerConfig):
        self.config = config
        if config.dtype != AUTO_DTYPE and config.dtype not in DTYPES:
            raise SwarmError(f"--dtype must be one of {', '.join([*DTYPES, AUTO_DTYPE])}, not {config.dtype!r}")
        if not config.new_swarm and not config.initial_peers:
            raise SwarmError("give --initial-peers to join a swarm, or --new-swarm to start one")
        check_announce_maddrs(config.announce_maddrs)
        if config.decode_wait_s < 0:
            raise SwarmError(f"--decode-wait-ms must be 0 or more, not {config.decode_wait_s * 1000:g}")
        check_relay_maddrs(config.relays)
        check_device(config.device)  # torch would fail only once the blocks load, obscurely
        if config.log_requests:
            for name in REQUEST_LOGGERS:  # their per-request and per-step lines are DEBUG
                logging.getLogger(name).setLevel(logging.DEBUG)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model(config.model, cache_dir=config.cache_dir, revision=config.revision)
        # the catalog shows the model by name, never by where it lies on this machine; a Hub model's swarm name
        # follows the commit its revision resolved to (models/naming.py)
        self.model_name = model_name(self.model_dir)
        self.dht_prefix = config.dht_prefix or self.model_name.swarm
        if config.swarm_key is not None:  # a private swarm's records live under a name only members can compute
            self.dht_prefix = blind_prefix(self.dht_prefix, config.swarm_key)
        model_config = load_config(self.model_dir)
        self.dtype_name = serving_dtype(config.dtype, model_config)  # the compute dtype, announced as is
        self.dtype = DTYPES[self.dtype_name]
        self.num_blocks_total = model_config.num_hidden_layers
        self.family = get_family(model_config)
        # clients use only servers of the very model they loaded: announced in every record
        self.fingerprint = model_fingerprint(self.model_dir)
        self.start, self.end = requested_span(config, self.num_blocks_total)
        self.adapters = tuple(adapter_name(path) for path in config.adapters)  # checked before anything loads
        if config.quant is not None and config.quant not in QUANT_MODES:
            raise SwarmError(f"--quant must be one of {', '.join(QUANT_MODES)}, not {config.quant!r}")
        if config.quant is not None and config.adapters:
            raise SwarmError("--quant and --adapters cannot be combined: LoRA adapters need the blocks' float Linears")
        if config.quant == "nf4":
            bnb_functional()  # a missing bitsandbytes is reported now, before the DHT starts
        # quantized blocks give slightly different outputs: announced as their own dtype, which clients opt into
        self.announced_dtype = config.quant or self.dtype_name
        self.since = 0.0  # DHT time this span was claimed (set when announced)
        request_bytes = max_message_bytes(config.max_tokens_per_request, model_config.hidden_size)
        self.peer_memory_bytes = int(config.peer_memory_mb * 1e6) if config.peer_memory_mb else 4 * request_bytes
        # all peers' request buffers together (server/peers.py): the cache budget leaves room for them
        self.total_memory_bytes = (
            int(config.total_memory_mb * 1e6) if config.total_memory_mb else MEMORY_PEERS * self.peer_memory_bytes
        )
        # forward graphs kept for their backwards (server/activations.py), on the compute device like the KV cache
        self.activation_cache_bytes = int(config.activation_cache_mb * 1e6)
        cache_tokens = config.cache_tokens or default_cache_tokens(
            model_config, self.end - self.start, self.dtype, config.device,
            reserved_bytes=self.total_memory_bytes + self.activation_cache_bytes,
        )  # fmt: skip
        # the KV-cache budget in block-tokens (a token's keys and values at one block): room for cache_tokens tokens
        # at every block of the span; a session reserves its tokens at each block it uses, no more
        self.cache_block_tokens = cache_tokens * (self.end - self.start)
        self.throughput, self.inference_throughput = 1.0, 1.0  # until measured on the loaded span
        self.speed: speed.Speed | None = None  # how those were found (server/speed.py), once the span is loaded
        self.backend: SpanBackend | None = None
        self.dht: hivemind.DHT | None = None
        self.peer_id, self.addrs = "", list[str]()
        self.budget: CacheBudget | None = None  # made on the server's event loop, in _serve
        self.inference: InferenceSessions | None = None
        self.handler: SpanHandler | None = None

    def run(self) -> None:
        cfg = self.config
        memory.share_one_arena()  # before the DHT, the event loop and the compute thread start (server/memory.py)
        key = load_or_create_identity(cfg.identity_path) if cfg.identity_path else None
        self.dht = start_dht(
            cfg.initial_peers,
            may_start_alone=cfg.new_swarm,
            reconnect_interval_s=cfg.reconnect_interval_s,
            # a restarted server dials the peers it knew at once (swarm/reconnect.py)
            peers_file=peers_file(cfg.identity_path) if cfg.identity_path else None,
            host=cfg.host,
            port=cfg.port,
            key=key,
            announce_maddrs=cfg.announce_maddrs,
            swarm_key=cfg.swarm_key,
            relays=cfg.relays,
            # reached only through relays: no other peer could ask this node for DHT records
            client_mode=bool(cfg.relays),
        )
        try:
            asyncio.run(self._serve())
        finally:
            if self.backend is not None:
                self.backend.shutdown()
            self.dht.shutdown()
            logger.info("Server stopped")

    def _load(self, start: int, end: int) -> None:
        """Load blocks [start, end) and measure them (blocking: run off the event loop once serving)."""
        cfg = self.config
        logger.info("Loading blocks %d:%d of %s", start, end, self.model_dir)
        self._keep_disk_budget(start, end)  # before: room for the shards this span downloads
        span = SpanModel.from_dir(self.model_dir, start, end, self.dtype, cfg.device)
        self._keep_disk_budget(start, end)
        if cfg.adapters:
            load_adapters(span, cfg.adapters)
        if cfg.quant is not None:
            before = module_bytes(span.layers)
            quantize(span.layers, cfg.quant)
            logger.info("Quantized blocks %d:%d to %s: %.2f MB per block (%.2f MB before)", start, end, cfg.quant,
                        module_bytes(span.layers) / (end - start) / 1e6, before / (end - start) / 1e6)  # fmt: skip
        stages = max(1, round(self.num_blocks_total / (end - start)))  # a chain of spans like this one
        later = max(0, round((self.num_blocks_total - end) / (end - start)))  # of them, after this one
        limits = BatchLimits(decode_wait_s=cfg.decode_wait_s, stages=stages, later_stages=later)
        activations = ActivationCache(self.activation_cache_bytes, host_share=cfg.host_share)
        backend = SpanBackend(span, self.dtype, cfg.device, cfg.max_tokens_per_request, limits, activations)
        self.speed = self._speed_of(backend)
        self.throughput, self.inference_throughput = self.speed.forward, self.speed.inference
        self.backend, self.start, self.end = backend, start, end

    def _speed_of(self, backend: SpanBackend) -> speed.Speed:
        """The speed to announce: the one this machine measured before for this model and dtype, else measured now
        on the loaded blocks (and kept in the cache folder for restarts, moves and neighbours)."""
        folder = Path(self.config.cache_dir) if self.config.cache_dir else default_cache_dir()
        key = speed.speed_key(self.fingerprint, self.announced_dtype, self.config.device)

        def measure() -> tuple[float, float]:
            logger.info("Measuring this server's speed (kept for later starts in %s)", folder)
            return backend.measure_throughput(), backend.measure_inference_throughput()

        return speed.known_speed(folder, key, measure, remeasure=self.config.throughput == "eval")

    def _keep_disk_budget(self, start: int, end: int) -> None:
        """Evict the cached shards of a Hub model that blocks start:end do not need, least recently used first, down
        to --max-disk-space (a no-op without one, or for a model that is no Hub snapshot)."""
        if self.config.max_disk_space_gb is None:
            return
        needed = weight_files_for(self.model_dir, [self.family.block_tensor_prefix(i) for i in range(start, end)])
        evicted = evict(self.model_dir, needed, int(self.config.max_disk_space_gb * 1e9))
        if evicted:
            logger.info("Evicted %d cached weight files no served block needs (--max-disk-space %g GB): %s",
                        len(evicted), self.config.max_disk_space_gb, ", ".join(evicted))  # fmt: skip

    def _record(self, state: ServerState) -> ServerRecord:
        return ServerRecord(
            state=state,
            start=self.start,
            end=self.end,
            throughput=self.throughput,
            throughput_source=speed.describe(self.speed),
            dtype=self.announced_dtype,
            addrs=tuple(self.addrs),
            fingerprint=self.fingerprint,
            version=__version__,
            max_tokens_per_request=self.config.max_tokens_per_request,
            cache_tokens_total=self.cache_block_tokens,
            cache_tokens_left=self._cache_tokens_left(),
            inference_throughput=self.inference_throughput,
            since=self.since,
            sessions_open=0 if self.inference is None else self.inference.open_sessions,
            queue_depth=self._queue_depth(),
            adapters=self.adapters,
        )

    def _queue_depth(self) -> float:
        return 0.0 if self.backend is None else round(self.backend.scheduler.queue_depth(), 3)

    async def _announce(self, state: ServerState) -> ServerRecord:
        if self.dht is None:
            raise RuntimeError("the server's DHT is started by run()")
        record = self._record(state)
        failed = await announce(self.dht, self.dht_prefix, self.peer_id, record, self.config.record_ttl_s)
        if failed is not None:
            logger.warning("Storing the DHT record (%s) failed: %s; next try in %.0f s", state, failed,
                           self.config.announce_interval_s)  # fmt: skip
        # a private swarm lists its models under a blinded catalog key, sealed like all its records: for members only
        entry = CatalogEntry(dht_prefix=self.dht_prefix, model=self.model_name.display,
                             num_blocks=self.num_blocks_total, announced_at=get_dht_time())  # fmt: skip
        key = catalog_key(self.config.swarm_key)
        failed = await announce_entry(self.dht, self.peer_id, entry, self.config.record_ttl_s, key)
        if failed is not None:
            logger.warning("Storing the catalog entry failed: %s; next try in %.0f s", failed,
                           self.config.announce_interval_s)  # fmt: skip
        return record

    async def _read_swarm(self) -> Mapping[str, ServerRecord]:
        if self.dht is None:
            raise RuntimeError("the server's DHT is started by run()")
        return await fetch_servers(self.dht, self.dht_prefix, self.num_blocks_total)

    def _cache_tokens_left(self) -> int:
        budget = self.budget
        return self.cache_block_tokens if budget is None else max(0, budget.capacity - budget.used)

    def describe(self) -> ServerInfo:
        """This server now, as rpc_info answers it."""
        if self.backend is None:
            raise RuntimeError("no span is loaded yet")
        limits = self.backend.limits
        return ServerInfo(
            start_block=limits.start,
            end_block=limits.end,
            version=__version__,
            fingerprint=self.fingerprint,
            dtype=self.announced_dtype,
            max_tokens_per_request=limits.max_tokens,
            max_position=limits.max_position,
            cache_tokens_total=self.cache_block_tokens,
            cache_tokens_left=self._cache_tokens_left(),
            sessions_open=0 if self.inference is None else self.inference.open_sessions,
            queue_depth=self._queue_depth(),
            throughput=self.throughput,
            inference_throughput=self.inference_throughput,
            pushes_received=0 if self.inference is None else self.inference.pushes_received,
            adapters=self.adapters,
        )

    async def _serve(self) -> None:
        if self.dht is None:
            raise RuntimeError("the server's DHT is started by run()")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        p2p = await self.dht.replicate_p2p()
        self.peer_id = p2p.peer_id.to_base58()
        self.addrs = self._addresses(visible_maddrs(self.dht))
        await self._join()
        handler = await self._start_handler(p2p)
        memory.freeze_startup_objects()  # what serving makes is collected in milliseconds (server/memory.py)
        self.since = self.since or get_dht_time()
        await self._announce(ServerState.ONLINE)
        self._print_serving()
        print("Others join with: --initial-peers " + " ".join(self.addrs), flush=True)
        print(f"Server ready: peer {self.peer_id}", flush=True)
        await self._live(stop)
        self._sessions().stop_accepting()  # before the record says so: a client may not have read it yet
        logger.info(activity.drain_line(self._activity(), self._sessions().open_sessions))
        await self._announce(ServerState.DRAINING)
        await lifecycle.drain(self._sessions(), handler, self.config.drain_timeout_s)
        # the DHT keeps the record that expires last, so the offline one must not expire before the online one
        await self._announce(ServerState.OFFLINE)
        await transport.unregister(p2p, self.config.request_timeout_s)
        await p2p.shutdown()
        sys.stdout.flush()

    def _addresses(self, visible: list[str]) -> list[str]:
        """The addresses announced in the record: with relays, first the relayed ones (p2pd lists them only once its
        reservation is made, and only for relays with public addresses)."""
        relayed = [f"{relay_circuit(relay)}/p2p/{self.peer_id}" for relay in self.config.relays]
        return list(dict.fromkeys([*relayed, *visible]))

    async def _join(self) -> None:
        """Claim a span (with --num-blocks) and load it."""
        n = self.config.num_blocks
        if n is not None:
            self.throughput = estimate_throughput(await self._read_swarm())

            async def claim(span: Span, since: float) -> ServerRecord:
                self.start, self.end = span
                self.since = since
                return await self._announce(ServerState.JOINING)

            (self.start, self.end), self.since = await lifecycle.claim_span(
                self._read_swarm, claim, self.num_blocks_total, n, self.peer_id
            )
        await asyncio.to_thread(self._load, self.start, self.end)

    async def _start_handler(self, p2p: P2P) -> SpanHandler:
        cfg = self.config
        if self.backend is None:
            raise RuntimeError("the span is loaded before the handler starts")
        peer_limits = PeerLimits(
            self.peer_memory_bytes, cfg.max_sessions_per_peer, cfg.max_sessions, cfg.peer_cache_share,
            memory_total_bytes=self.total_memory_bytes, streams_per_peer=cfg.max_streams_per_peer,
            streams_total=cfg.max_streams, host_share=cfg.host_share, reclaim_idle_s=cfg.reclaim_idle_s,
        )  # fmt: skip
        ledger = PeerLedger(peer_limits)
        self.backend.scheduler.on_exclusive_done = ledger.memory_return.computed
        self.budget = CacheBudget(self.cache_block_tokens)
        self.inference = InferenceSessions(
            self.backend,
            self.budget,
            ledger,
            alloc_timeout_s=cfg.alloc_timeout_s,
            idle_timeout_s=cfg.session_idle_timeout_s,
            chunk_tokens=cfg.inference_chunk_tokens,
            pusher=Pusher(p2p, self._read_swarm, cfg.request_timeout_s),
            arrival_timeout_s=cfg.arrival_timeout_s,
        )
        self.handler = SpanHandler(
            self.backend, self.inference, cfg.request_timeout_s, self.describe, arrival_timeout_s=cfg.arrival_timeout_s
        )
        limits = StreamLimits(
            int(cfg.max_frame_mb * 1e6), cfg.request_timeout_s, cfg.write_timeout_s, cfg.arrival_timeout_s
        )
        gate = None
        if cfg.swarm_key is not None:  # a private swarm: only peers that proved they hold its key are served
            members = Members(cfg.swarm_key)
            await members.register(p2p)
            gate = Gate(members.admits, refuse_outsider)
        await transport.register(p2p, self.handler, ledger, limits, gate)
        return self.handler

    def _sessions(self) -> InferenceSessions:
        if self.inference is None:
            raise RuntimeError("the handler is started before sessions are served")
        return self.inference

    def _print_serving(self) -> None:
        print(
            f"Serving blocks {self.start}:{self.end} of {self.config.model} as swarm {self.dht_prefix!r}, "
            f"{self.throughput:.0f} tokens/s per block ({speed.describe(self.speed)})",
            flush=True,
        )

    async def _live(self, stop: asyncio.Event) -> None:
        """Refresh the record every announce interval and, with --num-blocks, check for a better span now and then."""
        cfg, loop = self.config, asyncio.get_running_loop()
        rebalancing = cfg.num_blocks is not None and cfg.rebalance_interval_s > 0
        next_announce = loop.time() + cfg.announce_interval_s
        next_check = loop.time() + lifecycle.rebalance_delay(cfg.rebalance_interval_s) if rebalancing else float("inf")
        next_summary, summarized = loop.time() + cfg.summary_interval_s, self._activity()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                wake = min(next_announce, next_check, next_summary)
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, wake - loop.time()))
            if stop.is_set():
                return
            if loop.time() >= next_summary:
                now = self._activity()
                line = activity.summary(now.minus(summarized), cfg.summary_interval_s, self._sessions().open_sessions)
                if line is not None:
                    logger.info(line)
                next_summary, summarized = loop.time() + cfg.summary_interval_s, now
            if loop.time() >= next_announce:
                await self._announce(ServerState.ONLINE)
                # graphs kept for backwards that never came are freed even when no request arrives to evict them
                if self.backend is not None and (dropped := await self.backend.expire_kept()):
                    logger.info("Dropped %d kept forward graph(s) whose backward did not come", dropped)
                next_announce = loop.time() + cfg.announce_interval_s
            if loop.time() >= next_check:
                try:
                    await self._rebalance(stop)
                except Exception as e:  # noqa: BLE001 - a failed check or move must not end the server: it stays
                    self._stay(e)
                next_check = loop.time() + lifecycle.rebalance_delay(cfg.rebalance_interval_s)

    def _activity(self) -> activity.Activity:
        """What this server served so far (server/activity.py)."""
        handler, sessions = self.handler, self._sessions()
        return activity.Activity(
            requests=0 if handler is None else handler.served, sessions=sessions.sessions_opened,
            steps=sessions.steps_served, tokens=(0 if handler is None else handler.tokens) + sessions.step_tokens,
            failed=(0 if handler is None else handler.rejected) + sessions.steps_failed,
        )  # fmt: skip

    async def _rebalance(self, stop: asyncio.Event) -> None:
        """Move to another span if that raises the swarm's bottleneck enough (see placement.should_move)."""
        servers = dict(await self._read_swarm())
        servers[self.peer_id] = self._record(ServerState.ONLINE)
        target = should_move(self.num_blocks_total, self.peer_id, servers, self.config.balance_quality)
        if target is None:
            return
        old = (self.start, self.end, self.since)
        (self.start, self.end), self.since = target, get_dht_time()
        mine = await self._announce(ServerState.JOINING)
        await lifecycle.claim_wait()
        if claimed_first(self.peer_id, mine, await self._read_swarm()):
            logger.info("Another server claimed blocks %d:%d first; staying", *target)
            self.start, self.end, self.since = old
            await self._announce(ServerState.ONLINE)
            return
        logger.info("Moving from blocks %d:%d to %d:%d: the swarm's bottleneck would grow", old[0], old[1], *target)
        await self._move(target, stop)

    def _stay(self, error: Exception) -> None:
        """After a failed rebalance, serve the span still loaded (announced at the next refresh)."""
        if self.backend is not None:
            self.start, self.end = self.backend.limits.start, self.backend.limits.end
        logger.warning("Rebalancing failed; serving blocks %d:%d on: %s: %s", self.start, self.end,
                       type(error).__name__, error)  # fmt: skip
        self._sessions().reopen()

    async def _move(self, target: Span, stop: asyncio.Event) -> None:
        """Drain the current span, load `target`, serve it (unless told to stop meanwhile: the server then leaves)."""
        sessions, handler, old = self._sessions(), self.handler, self.backend
        if handler is None or old is None:
            raise RuntimeError("only a serving server moves")
        await lifecycle.drain(sessions, handler, self.config.drain_timeout_s)
        if stop.is_set():
            return  # its sessions are closed already: leaving now keeps within one drain deadline
        await self._announce(ServerState.JOINING)  # the drain may have outlasted the claim's record
        await asyncio.to_thread(self._load, *target)
        if self.backend is None:
            raise RuntimeError("the new span did not load")
        handler.backend = sessions.backend = self.backend
        old.shutdown()
        sessions.reopen()
        await self._announce(ServerState.ONLINE)
        self._print_serving()
