"""Running the HTTP server: `swarmlm api` (the OpenAI-compatible API and the monitor) and `swarmlm monitor`
(`swarmlm status`, which prints the monitor's picture once, is in status.py: it needs no model code)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from swarmlm.api.app import Routes
from swarmlm.api.cache_share import swarm_budget
from swarmlm.api.engine import Engine
from swarmlm.api.monitor import Monitor, short_id
from swarmlm.api.status import client_dht
from swarmlm.checks import check_can_listen
from swarmlm.client.model import AutoDistributedModelForCausalLM, DistributedCausalLMMixin
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.errors import SwarmError
from swarmlm.models.loading import load_config, load_tokenizer, resolve_model
from swarmlm.models.naming import model_name

logger = logging.getLogger(__name__)

READY_LINE = "API ready: "  # then the base URL; tests and the demo wait for it
MONITOR_READY_LINE = "Monitor ready: "
MONITOR_LINE = "Monitor page: "  # `swarmlm api` says where its monitor page is, after its ready line
# on SIGINT/SIGTERM, how long handlers still running may take to finish (the engine has ended their generations)
SHUTDOWN_TIMEOUT_S = 10.0
# a connection that has not sent a whole request (headers, then body) in this long is closed, as is one idle as long
# between requests: half-sent requests would otherwise hold a descriptor each for ever
HTTP_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class ApiOptions:
    model: str  # Hub repository, model name, .gguf file or Hugging Face folder (its blocks served by the swarm)
    initial_peers: tuple[str, ...]  # multiaddrs of swarm peers
    host: str = "127.0.0.1"  # interface the HTTP server listens on
    port: int = 8000  # HTTP port (0: any free port)
    served_name: str | None = None  # the model's name in the API (default: its display name, models/naming.py)
    dht_prefix: str | None = None  # swarm name (default: the model's swarm name, as its servers derive it)
    # requests generating at once; more wait for their turn. Servers hold 16 sessions per peer by default
    # (--max-sessions-per-peer), and this server is one peer to them
    max_concurrent: int = 16
    missing_blocks_timeout_s: float = 10.0  # a request waits this long for missing blocks, then gets a 503
    http_timeout_s: float = HTTP_TIMEOUT_S  # longest a request's headers, or its body, may take to arrive
    revision: str | None = None  # branch, tag or commit of a Hub model (None: its default branch)
    swarm_key: bytes | None = None  # the secret of the private swarm to use (None: an open swarm)
    api_keys: tuple[str, ...] = ()  # requests to /v1/ must carry one as a bearer token, which names their user
    # session tokens (batch x length) the API's requests may hold on the servers, shared by its users (None: the
    # share of the servers' announced caches that one peer may hold, api/cache_share.py)
    cache_budget_tokens: int | None = None


def served_names(model: str, served_name: str | None, model_dir: Path | None = None) -> tuple[str, ...]:
    """The names clients may ask for: the one /v1/models lists first (the chosen name, else the model's display
    name: never a path), then the display and swarm names and the model argument as typed (a Hub repository's id,
    as OpenAI clients of other servers name it). The names come from the folder `model` resolved to, if given."""
    name = model_name(model if model_dir is None else model_dir)
    return tuple(dict.fromkeys([served_name or name.display, name.display, name.swarm, model]))


def client_info(model: DistributedCausalLMMixin, engine: Engine) -> dict[str, Any]:
    """What this server's own client knows: the route of its last session and its recent requests."""
    manager = model._client().manager
    route = []
    for peer, start, end in engine.route:
        record = manager.servers.get(peer)
        measured = manager.health.measured(peer, record.throughput if record else 0.0)
        step_ms = None if measured is None else 1000 * (measured[0] + (end - start) / measured[1])
        route.append({"peer_id": peer, "short_id": short_id(peer), "start": start, "end": end,
                      "step_ms": None if step_ms is None else round(step_ms, 1)})  # fmt: skip
    now = time.time()
    recent = [
        {
            "age_s": round(now - stats.finished_at, 1),
            "ttft_ms": None if stats.time_to_first_token_s is None else round(1000 * stats.time_to_first_token_s, 1),
            "tokens": stats.completion_tokens,
            "tokens_per_s": round(stats.completion_tokens / stats.duration_s, 1) if stats.duration_s > 0 else None,
            "outcome": stats.outcome,
        }
        for stats in reversed(engine.recent)
    ]
    return {"route": route, "recent": recent}


def cache_budget(manager: SequenceManager, fixed: int | None) -> Callable[[], int | None]:
    """The API's cache budget in session tokens, as the ledger reads it on the client's loop: `fixed`, else what the
    servers in view announce (None while no server of some block announces a cache)."""

    def budget() -> int | None:
        if fixed is not None:
            return fixed
        spans = [(record.start, record.end, record.cache_tokens_total) for record in manager.servers.values()]
        return swarm_budget(spans, manager.num_blocks) or None

    return budget


def run_api(options: ApiOptions, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve the API until SIGINT/SIGTERM; `on_ready` is called with the base URL once it listens (the port it got,
    when asked for port 0)."""
    check_can_listen(options.host, options.port)  # before the model loads and the swarm is joined
    model_dir = resolve_model(options.model, revision=options.revision)
    names = served_names(options.model, options.served_name, model_dir)
    # the swarm is named after the resolved model, as its servers name it (a Hub model's after its commit)
    dht_prefix = options.dht_prefix or model_name(model_dir).swarm
    with AutoDistributedModelForCausalLM.from_pretrained(
        str(model_dir), initial_peers=list(options.initial_peers),
        missing_blocks_timeout_s=options.missing_blocks_timeout_s, dht_prefix=dht_prefix, swarm_key=options.swarm_key,
    ) as model:  # fmt: skip
        config = load_config(model_dir)
        manager = model._client().manager
        engine = Engine(model, load_tokenizer(model_dir), config.max_position_embeddings, options.max_concurrent,
                        cache_budget_tokens=cache_budget(manager, options.cache_budget_tokens))  # fmt: skip
        if manager.dht is None:
            raise RuntimeError("the model's client has no DHT")
        monitor = Monitor(manager.dht, lambda: client_info(model, engine), options.swarm_key)
        try:
            routes = Routes(engine, names, monitor, options.http_timeout_s, options.api_keys)
            asyncio.run(_serve(routes, monitor, options.host, options.port, READY_LINE, on_ready, engine.close,
                               options.http_timeout_s, show_monitor=True))  # fmt: skip
        finally:
            engine.close()


def run_monitor(initial_peers: tuple[str, ...], host: str, port: int, swarm_key: bytes | None = None) -> None:
    """Serve the monitor page of a swarm (no model, no API) until SIGINT/SIGTERM."""
    check_can_listen(host, port)
    dht = client_dht(initial_peers, swarm_key)
    try:
        monitor = Monitor(dht, swarm_key=swarm_key)
        asyncio.run(_serve(Routes(None, (), monitor), monitor, host, port, MONITOR_READY_LINE))
    finally:
        dht.shutdown()


async def _serve(
    routes: Routes, monitor: Monitor, host: str, port: int, ready_line: str,
    on_ready: Callable[[str], None] | None = None, on_stop: Callable[[], None] | None = None,
    http_timeout_s: float = HTTP_TIMEOUT_S, show_monitor: bool = False,
) -> None:  # fmt: skip
    """Serve until SIGINT or SIGTERM; then on_stop (the engine ends the requests still generating, whose handlers
    then finish) before the server closes its connections."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # a client that disconnects cancels its handler at once: its generation stops and its session closes
    # keepalive_timeout also closes a connection that has not sent a whole request's headers since it opened
    runner = web.AppRunner(routes.app(), handler_cancellation=True, access_log=None, keepalive_timeout=http_timeout_s)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        try:
            await site.start()
        except OSError as e:  # taken since it was checked, or refused for another reason
            raise SwarmError(f"cannot serve HTTP on {host}:{port}: {e.strerror or e}") from e
        bound = runner.addresses[0]
        print(f"{ready_line}http://{host}:{bound[1]}", flush=True)
        if show_monitor:
            print(f"{MONITOR_LINE}http://{host}:{bound[1]}/", flush=True)
        if on_ready is not None:
            on_ready(f"http://{host}:{bound[1]}")
        await stop.wait()
    finally:
        if on_stop is not None:
            await asyncio.to_thread(on_stop)
        await monitor.close()
        await runner.cleanup()
