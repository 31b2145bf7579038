"""Configuration of servers and clients: frozen data, one field per option, units in the names.

A field that is a user option carries its help text (and, for a command-line flag, how the flag reads) as metadata:
the `swarmlm` flags and the options reference page are generated from it (cli/flags.py, cli/options_doc.py).
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any, TypeVar

from swarmlm.checks import (
    COUNT,
    FRACTION,
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    POSITIVE_INT,
    PROBABILITY,
    Check,
    Range,
    boolean,
    in_range,
    optional_string_list,
    optional_text,
    peers,
    string_list,
    swarm_key_value,
)
from swarmlm.errors import ConfigError
from swarmlm.models.constants import DEFAULT_MODEL, QUANT_MODES, WIRE_DTYPE_NAMES
from swarmlm.swarm.routing import ROUTING_MODES

T = TypeVar("T")
OPTION = "swarmlm.option"  # the key of a field's metadata that holds its Option


@dataclass(frozen=True)
class Option:
    """What a config field means to a user, and how the command line takes it where a command takes it as a flag."""

    help: str
    flag: str | None = None  # None: derived from the field name
    positional: bool = False  # a command's positional argument (named as the field), not a flag
    allowed: Range | None = None  # a numeric flag's values (a config checks its own values in swarmlm.checks)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    nargs: str | None = None  # "*" or "+" for a tuple field
    scale: float = 1.0  # the flag's value is the field's times this (1000: a field in s, a flag in ms)

    def flag_for(self, name: str) -> str:
        if self.positional:
            return name
        # units stay in field names, not in flags: alloc_timeout_s is --alloc-timeout (in seconds)
        return self.flag or "--" + name.removesuffix("_s").replace("_", "-")

    def dest_for(self, name: str) -> str:
        """The attribute of the parsed arguments that holds the flag's value (argparse derives it from the flag)."""
        return self.flag_for(name).lstrip("-").replace("-", "_")


def option(
    default: T,
    help: str,
    *,
    flag: str | None = None,
    allowed: Range | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    nargs: str | None = None,
    scale: float = 1.0,
) -> T:
    """A config field with a default that is a user option, described by Option's fields."""
    how = Option(help, flag=flag, allowed=allowed, choices=choices, metavar=metavar, nargs=nargs, scale=scale)
    return field(default=default, metadata={OPTION: how})


def positional(help: str) -> dict[str, Option]:
    """The metadata of a required field that is a command's positional argument, named as the field."""
    return {OPTION: Option(help, positional=True)}


def option_of(config_field: Field[Any]) -> Option | None:
    found = config_field.metadata.get(OPTION)
    return found if isinstance(found, Option) else None


def options(config: type) -> dict[str, tuple[Field[Any], Option]]:
    """The fields of a config class that are user options, in their order (field name -> field and option)."""
    found = ((each, option_of(each)) for each in fields(config))
    return {each.name: (each, described) for each, described in found if described is not None}


# how a server finds the speed it announces (server/speed.py)
THROUGHPUT_MODES = ("auto", "eval")
SERVER_DTYPES = ("float32", "bfloat16", "float16", "auto")
MODEL_HELP = (
    f"Hub repository ORG/NAME (or ORG/NAME/FILE.gguf), model name ({DEFAULT_MODEL}), .gguf file or Hugging Face folder"
)
REVISION_HELP = "branch, tag or commit of a Hub model (default: its default branch)"
DHT_PREFIX_HELP = "swarm name, under which its records live on the DHT (default: derived from the model)"


@dataclass(frozen=True)
class ServerConfig:
    model: str = field(metadata=positional(MODEL_HELP))
    start_block: int = 0  # first block served (ignored when num_blocks is given); `swarmlm serve --blocks START:END`
    end_block: int = 0  # one past the last block served (ignored when num_blocks is given)
    num_blocks: int | None = option(
        None, "serve N consecutive blocks where the swarm is weakest (and move)", allowed=POSITIVE_INT, metavar="N"
    )
    new_swarm: bool = option(
        False,
        "start even if no initial peer answers: the first node of a swarm (initial peers given too are joined when "
        "they answer, now or later)",
    )
    initial_peers: tuple[str, ...] = option((), "multiaddrs of swarm peers to join", nargs="*", metavar="MADDR")
    host: str = option("0.0.0.0", "interface to listen on (default: all)")
    port: int = option(0, "TCP port to listen on (default: any free port)", allowed=PORT)
    # the secret of a private swarm (swarm/private.py; None: an open swarm); its flag names the key file
    swarm_key: bytes | None = option(None, "join (or start) the private swarm of this key file", metavar="FILE")
    announce_maddrs: tuple[str, ...] = option(
        (),
        "addresses others should dial, e.g. /ip4/203.0.113.7/tcp/31337 behind a port forward (default: the "
        "listening ones)",
        nargs="*",
        metavar="MADDR",
    )
    relays: tuple[str, ...] = option(
        (),
        "for a server that accepts no inbound connections (behind NAT or a firewall): be dialled through these "
        "relay peers (full multiaddrs ending in /p2p/<peer id>, e.g. a `swarmlm dht` node)",
        flag="--relay",
        nargs="+",
        metavar="MADDR",
    )
    identity_path: str | None = option(
        None,
        "key file that keeps this node's peer id across restarts (created, mode 0600, if missing)",
        flag="--identity",
        metavar="PATH",
    )
    reconnect_interval_s: float = option(
        15.0,
        "seconds between re-dials of the initial peers and met peers missing from the DHT routing table (a node that "
        "restarted is found again within about this long; 0: never)",
        allowed=NON_NEGATIVE,
    )
    dtype: str = option(
        "float32", "compute dtype of the blocks (auto: the checkpoint's own, else float32)", choices=SERVER_DTYPES
    )
    device: str = option("cpu", "torch device, e.g. cpu or cuda")
    dht_prefix: str | None = option(None, DHT_PREFIX_HELP)
    cache_dir: str | None = option(None, "where converted models are kept (default ~/.cache/swarmlm)")
    revision: str | None = option(None, REVISION_HELP)
    max_disk_space_gb: float | None = option(
        None,
        "GB the Hub cache may hold for this model: cached shards no served block needs are deleted, least recently "
        "used first, to stay under it (never one in use; default: no limit)",
        flag="--max-disk-space",
        allowed=POSITIVE,
        metavar="GB",
    )
    max_tokens_per_request: int = option(8192, "batch * sequence tokens one request may carry", allowed=POSITIVE_INT)
    request_timeout_s: float = 60.0  # longest a request may take to arrive in full
    num_threads: int | None = option(None, "torch compute threads (default: torch's choice)", allowed=POSITIVE_INT)
    throughput: str = option(
        "auto",
        "the speed this server announces: auto (measured once on this machine for this model, dtype and threads, "
        "then kept in the cache folder: restarts announce the same) or eval (measured again now, and kept)",
        choices=THROUGHPUT_MODES,
    )
    cache_tokens: int | None = option(
        None,
        "KV-cache budget in tokens, batch * max_length summed over sessions (default: 1/4 of free memory)",
        allowed=POSITIVE_INT,
    )
    alloc_timeout_s: float = option(
        5.0, "seconds a session waits for cache room, first come first served (0: do not wait)", allowed=NON_NEGATIVE
    )
    session_idle_timeout_s: float = option(
        300.0, "seconds an inference session without steps stays open", allowed=POSITIVE
    )
    decode_wait_s: float = option(
        0.1,
        "longest a decode step waits for the steps of other recently active sessions, to share one forward with "
        "them (0: never wait)",
        flag="--decode-wait-ms",
        scale=1000,
        allowed=NON_NEGATIVE,
    )
    inference_chunk_tokens: int = 1024  # long prompts are run through the blocks this many tokens at a time
    peer_memory_mb: float | None = option(
        None, "MB of requests one peer may have buffered (default: 4 maximal requests)", allowed=POSITIVE
    )
    max_sessions_per_peer: int = option(16, "inference sessions one peer may hold open", allowed=POSITIVE_INT)
    max_sessions: int = option(256, "inference sessions all peers together may hold open", allowed=POSITIVE_INT)
    peer_cache_share: float = option(0.5, "fraction of the KV cache one peer may hold", allowed=FRACTION)
    write_timeout_s: float = option(
        30.0, "seconds a reply may wait for the peer to read it before its stream is closed", allowed=POSITIVE
    )
    arrival_timeout_s: float = option(
        5.0, "seconds a request or step under way may wait for its next bytes before it is refused", allowed=POSITIVE
    )
    drain_timeout_s: float = option(
        30.0,
        "seconds open inference sessions may go on when the server leaves or moves (then they are closed)",
        allowed=NON_NEGATIVE,
    )
    rebalance_interval_s: float = option(
        60.0, "seconds between checks whether a --num-blocks server should move (0: never)", allowed=NON_NEGATIVE
    )
    balance_quality: float = option(
        0.75, "move when the swarm's bottleneck throughput < this * its bottleneck after the move", allowed=FRACTION
    )
    announce_interval_s: float = option(10.0, "seconds between refreshes of the DHT record", allowed=POSITIVE)
    summary_interval_s: float = option(
        60.0, "seconds between one-line activity summaries in the log (none while idle)", allowed=POSITIVE
    )
    log_requests: bool = option(
        False,
        "log every request, batch and inference step at INFO (DEBUG otherwise), to watch what one server does "
        "(SWARMLM_LOG_REQUESTS=1 sets it)",
    )
    # longer than announce_interval_s: covers missed refreshes
    record_ttl_s: float = option(
        30.0, "seconds a record lives unrefreshed (a crashed server is forgotten then)", allowed=POSITIVE
    )
    quant: str | None = option(
        None,
        "store the blocks' Linear weights as int8 (~4x less memory) or nf4 (4-bit, ~7x less; needs bitsandbytes); "
        "announced as that dtype, which clients accept only when their accepted_dtypes include it",
        choices=QUANT_MODES,
    )
    adapters: tuple[str, ...] = option(
        (),
        "PEFT LoRA adapter folders for the served blocks; clients name one by its folder name",
        nargs="+",
        metavar="PATH",
    )
    max_frame_mb: float = option(
        4.0,
        "largest frame a peer may send, in MB (frames of swarmlm's own peers carry at most 1 MiB of tensors)",
        allowed=POSITIVE,
    )
    activation_cache_mb: float = option(
        1024.0,
        "MB of forward activations kept for the backward that follows, so a training step's forward is not "
        "recomputed (on the compute device; 0: keep none)",
        allowed=NON_NEGATIVE,
    )
    # fairness between hosts (server/peers.py, server/fairness.py); a host is the remote address of a peer's streams
    host_share: float = option(
        0.5,
        "fraction of the KV cache, session slots, buffered bytes and streams the peers of one address may hold",
        allowed=FRACTION,
    )
    total_memory_mb: float | None = option(
        None, "MB of requests all peers together may have buffered (default: 8 peers' bounds)", allowed=POSITIVE
    )
    max_streams_per_peer: int | None = option(
        None, "streams one peer may hold open (default: max sessions per peer + 64)", allowed=POSITIVE_INT
    )
    max_streams: int | None = option(
        None, "streams all peers together may hold open (default: 8 per session slot)", allowed=POSITIVE_INT
    )
    reclaim_idle_s: float = option(
        2.0,
        "when a pool is full and a peer waits, holders idle this many seconds are closed first (their clients replay "
        "elsewhere)",
        allowed=NON_NEGATIVE,
    )


# --- ClientConfig: a check per field (fields without one, if any, are taken as they are) ---


def _accepted_dtypes(name: str, value: object) -> None:
    known = ("float32", "bfloat16", "float16", *QUANT_MODES)  # the compute dtypes servers announce, and quantized
    string_list(name, value)
    unknown = sorted(set(value) - set(known))  # type: ignore[call-overload]  # a collection of str, checked above
    if unknown or not value:
        raise ConfigError(f"{name} must name some of {', '.join(known)}, not {value!r}")


def _wire_dtype(name: str, value: object) -> None:
    if value not in WIRE_DTYPE_NAMES:
        raise ConfigError(f"{name} must be one of {', '.join(WIRE_DTYPE_NAMES)}, not {value!r}")


def _routing(name: str, value: object) -> None:
    if value not in ROUTING_MODES:
        raise ConfigError(f"{name} must be one of {', '.join(ROUTING_MODES)}, not {value!r}")


CLIENT_CHECKS: dict[str, Check] = {
    "initial_peers": peers,
    "dht_prefix": optional_text,
    "max_tokens_per_request": in_range(POSITIVE_INT),
    "request_timeout_s": in_range(POSITIVE),
    "liveness_check_s": in_range(NON_NEGATIVE),
    "missing_blocks_timeout_s": in_range(NON_NEGATIVE),
    "busy_wait_s": in_range(NON_NEGATIVE),
    "max_retries": in_range(COUNT),
    "ban_base_s": in_range(NON_NEGATIVE),
    "ban_max_s": in_range(NON_NEGATIVE),
    "swarm_refresh_interval_s": in_range(POSITIVE),
    "dht_timeout_s": in_range(POSITIVE),
    "allowed_servers": optional_string_list,
    "blocked_servers": string_list,
    "accepted_dtypes": _accepted_dtypes,
    "route_tie_tolerance": in_range(NON_NEGATIVE),
    "route_stickiness": in_range(NON_NEGATIVE),
    "active_adapter": optional_text,
    "sticky_route_s": in_range(NON_NEGATIVE),
    "use_push": boolean,
    "verify_probability": in_range(PROBABILITY),
    "verify_first_requests": in_range(COUNT),
    "report_ttl_s": in_range(POSITIVE),
    "swarm_key": swarm_key_value,
    "wire_dtype": _wire_dtype,
    "ping_timeout_s": in_range(POSITIVE),
    "connect_timeout_s": in_range(POSITIVE),
    "explore_interval_s": in_range(NON_NEGATIVE),
    "routing": _routing,
}


def check_client_config(config: ClientConfig) -> None:
    """Raise ConfigError naming the first field of `config` with a value of the wrong type or out of range."""
    for entry in fields(config):
        check = CLIENT_CHECKS.get(entry.name)
        if check is not None:
            check(entry.name, getattr(config, entry.name))


@dataclass(frozen=True)
class ClientConfig:
    initial_peers: tuple[str, ...] = option((), "multiaddrs of swarm peers to join", nargs="+", metavar="MADDR")
    dht_prefix: str | None = option(None, DHT_PREFIX_HELP)
    max_tokens_per_request: int = option(
        1024, "bigger batches are split into concurrent sub-batches of this many tokens"
    )
    request_timeout_s: float = option(60.0, "a span call taking longer counts as a server failure")
    liveness_check_s: float = option(
        5.0, "a reply awaited this long: ping the server; silent as long again = failed (0: off)"
    )
    missing_blocks_timeout_s: float = option(
        30.0, "seconds to wait for a server to cover a block before giving up", allowed=NON_NEGATIVE
    )
    max_retries: int = option(10, "failed span calls tolerated per request before the error is raised")
    busy_wait_s: float = option(
        10.0,
        "seconds to keep trying when every server of some blocks answered busy (the swarm is full), before "
        "SwarmBusyError says when to come back; also the longest a busy server is avoided",
        allowed=NON_NEGATIVE,
    )
    ban_base_s: float = option(1.0, "first ban of a failed server; doubles on each further failure")
    ban_max_s: float = option(60.0, "longest ban")
    swarm_refresh_interval_s: float = option(5.0, "how often the swarm view is re-read from the DHT in the background")
    dht_timeout_s: float = option(10.0, "longest a DHT read or store may take before it counts as failed")
    allowed_servers: tuple[str, ...] | None = option(None, "peer ids of the only servers to use (None: any server)")
    blocked_servers: tuple[str, ...] = option((), "peer ids of servers never to use")
    accepted_dtypes: tuple[str, ...] = option(("float32", "bfloat16", "float16"), "compute dtypes of servers to use")
    route_tie_tolerance: float = option(
        0.05, "routes within this fraction of the cheapest are drawn at random (spreads load)"
    )
    route_stickiness: float = option(
        0.2, "the servers used last keep their blocks until another is this fraction cheaper"
    )
    active_adapter: str | None = option(
        None, "LoRA adapter (folder name on the servers) every block runs with; None: none"
    )
    sticky_route_s: float = option(60.0, "how long the servers used last stay preferred after their last use")
    use_push: bool = option(
        True, "inference steps travel server to server (each pushes to the next), not via the client"
    )
    verify_probability: float = option(
        0.05, "chance that a span's result is re-run on independent servers and compared"
    )
    verify_first_requests: int = option(2, "results of a server are always checked until it passed this many checks")
    report_ttl_s: float = option(3600.0, "how long this client's reports of wrong results stay on the DHT")
    swarm_key: bytes | None = option(
        None,
        "the 32-byte secret of a private swarm (from a `swarmlm swarm-key` file); None: an open swarm",
        metavar="FILE",
    )
    wire_dtype: str = option(
        "float32", "activations travel as float32 (exact), bfloat16/float16 (half) or int8 (a quarter)"
    )
    ping_timeout_s: float = option(
        2.0, "servers not yet called get one timed rpc_info before routing; longer = this far"
    )
    connect_timeout_s: float = option(
        5.0, "longest a first connection to a server may take; one that fails is avoided, not retried at once"
    )
    explore_interval_s: float = option(
        30.0, "at most one route per this many s tries a server never measured (0: never)"
    )
    routing: str = option(
        "auto", '"latency" | "throughput" | "auto": latency for inference sessions, throughput otherwise'
    )

    def __post_init__(self) -> None:
        # a wrong value fails here, naming its field, not deep in a request later (or never, silently)
        check_client_config(self)
