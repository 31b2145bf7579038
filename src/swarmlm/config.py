"""Configuration of servers and clients: frozen data, one commented field per line, units in the names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    model: str  # model name, .gguf file or Hugging Face folder
    start_block: int = 0  # first block served (ignored when num_blocks is given)
    end_block: int = 0  # one past the last block served (ignored when num_blocks is given)
    num_blocks: int | None = None  # serve this many consecutive blocks where the swarm is weakest, and rebalance
    initial_peers: tuple[str, ...] = ()  # multiaddrs of DHT peers to join
    new_swarm: bool = False  # start a fresh DHT instead of joining one
    host: str = "0.0.0.0"  # interface to listen on
    port: int = 0  # TCP port to listen on (0: any free port)
    announce_maddrs: tuple[str, ...] = ()  # addresses others dial (port forward, proxy); default: the listening ones
    identity_path: str | None = None  # Ed25519 key file keeping the peer id across restarts (created if missing)
    relays: tuple[str, ...] = ()  # relay peers (.../p2p/<id>) to be dialled through when no inbound connection works
    dtype: str = "float32"  # compute dtype of the blocks: float32 | bfloat16 | float16 | auto (the checkpoint's)
    device: str = "cpu"  # torch device of the blocks
    dht_prefix: str | None = None  # name the swarm's records live under (default: derived from the model)
    cache_dir: str | None = None  # where converted models are kept (default: ~/.cache/swarmlm)
    max_tokens_per_request: int = 8192  # batch * sequence tokens one request may carry
    request_timeout_s: float = 60.0  # longest a request may take to arrive in full
    announce_interval_s: float = 10.0  # how often the DHT record is refreshed
    record_ttl_s: float = 30.0  # how long a record lives without refresh (covers two missed refreshes)
    num_threads: int | None = None  # torch intra-op threads for compute (default: torch's choice)
    cache_tokens: int | None = None  # KV-cache budget in tokens (batch * max_length summed over sessions)
    alloc_timeout_s: float = 5.0  # how long a session waits for cache room before "server busy"
    session_idle_timeout_s: float = 300.0  # an inference session without steps for this long is closed
    decode_wait_s: float = 0.1  # a decode batch waits up to this long for steps of other recently active sessions
    inference_chunk_tokens: int = 1024  # long prompts are run through the blocks this many tokens at a time
    peer_memory_mb: float | None = None  # MB of requests one peer may have buffered (default: 4 maximal requests)
    max_sessions_per_peer: int = 16  # inference sessions one peer may hold open
    max_sessions: int = 256  # inference sessions all peers together may hold open
    peer_cache_share: float = 0.5  # fraction of the KV-cache budget one peer may hold
    write_timeout_s: float = 30.0  # a peer that does not read a reply for this long loses its stream
    drain_timeout_s: float = 30.0  # on leaving (or moving), open inference sessions may finish for this long
    rebalance_interval_s: float = 60.0  # how often a num_blocks server checks whether to move (0: never)
    balance_quality: float = 0.75  # move when the swarm's bottleneck < quality * its bottleneck after the move
    quant: str | None = None  # "int8" or "nf4": blocks' Linear weights stored so (announced as that dtype)
    adapters: tuple[str, ...] = ()  # folders of PEFT LoRA adapters for the served blocks, named by folder name
    max_frame_mb: float = 4.0  # largest frame (protobuf part) a peer may send, in MB (ours carry <= 1 MiB of tensors)
    swarm_key: bytes | None = None  # secret of a private swarm (swarm/private.py); None: an open swarm
    # fairness between hosts (server/peers.py, server/fairness.py); a host is the remote address of a peer's streams
    host_share: float = 0.5  # fraction of the cache, session slots, buffered bytes and streams one host may hold
    total_memory_mb: float | None = None  # MB of requests all peers may have buffered (default: 8 peers' bounds)
    max_streams_per_peer: int | None = None  # streams one peer may hold open (default: max_sessions + 64)
    max_streams: int | None = None  # streams all peers may hold open (default: 8 per session slot)
    reclaim_idle_s: float = 2.0  # when a pool is full, holders idle this long are closed first for a peer that waits


@dataclass(frozen=True)
class ClientConfig:
    initial_peers: tuple[str, ...] = ()  # multiaddrs of DHT peers to join
    dht_prefix: str | None = None  # name the swarm's records live under (default: derived from the model)
    max_tokens_per_request: int = 1024  # bigger batches are split into concurrent sub-batches of this many tokens
    request_timeout_s: float = 60.0  # a span call taking longer counts as a server failure
    liveness_check_s: float = 5.0  # a reply awaited this long: ping the server; silent as long again = failed (0: off)
    missing_blocks_timeout_s: float = 30.0  # how long to wait for a server to cover a block before giving up
    max_retries: int = 10  # failed span calls tolerated per request before the error is raised
    ban_base_s: float = 1.0  # first ban of a failed server; doubles on each further failure
    ban_max_s: float = 60.0  # longest ban
    swarm_refresh_interval_s: float = 5.0  # how often the swarm view is re-read from the DHT in the background
    dht_timeout_s: float = 10.0  # longest a DHT read or store may take before it counts as failed
    allowed_servers: tuple[str, ...] | None = None  # peer ids of the only servers to use (None: any server)
    blocked_servers: tuple[str, ...] = ()  # peer ids of servers never to use
    accepted_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")  # compute dtypes of servers to use
    route_tie_tolerance: float = 0.05  # routes within this fraction of the cheapest are drawn at random (spreads load)
    route_stickiness: float = 0.2  # the servers used last keep their blocks until another is this fraction cheaper
    active_adapter: str | None = None  # LoRA adapter (folder name on the servers) every block runs with; None: none
    sticky_route_s: float = 60.0  # how long the servers used last stay preferred after their last use
    use_push: bool = True  # inference steps travel server to server (each pushes to the next), not via the client
    verify_probability: float = 0.05  # chance that a span's result is re-run on independent servers and compared
    verify_first_requests: int = 2  # results of a server are always checked until it passed this many checks
    report_ttl_s: float = 3600.0  # how long this client's reports of wrong results stay on the DHT
    swarm_key: bytes | None = None  # secret of a private swarm (swarm/private.py); None: an open swarm
    wire_dtype: str = "float32"  # activations travel as float32 (exact), bfloat16/float16 (half) or int8 (a quarter)
    ping_timeout_s: float = 2.0  # servers not yet called get one timed rpc_info before routing; longer = this far
    explore_interval_s: float = 30.0  # at most one route per this many s tries a server never measured (0: never)
    routing: str = "auto"  # "latency" | "throughput" | "auto": latency for inference sessions, throughput otherwise

    def __post_init__(self) -> None:
        # a wrong value fails here, naming its field, not deep in a request later (or never, silently)
        from swarmlm.checks import check_client_config

        check_client_config(self)
