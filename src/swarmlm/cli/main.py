"""The `swarmlm` command: argparse -> config -> objects. The only place that reads the environment."""

from __future__ import annotations

import argparse
import logging
import sys

from swarmlm.cli.args import Parser, check_arguments, fraction, non_negative, port, positive, positive_int
from swarmlm.config import ServerConfig
from swarmlm.errors import SwarmError
from swarmlm.models.constants import DEFAULT_MODEL, QUANT_MODES
from swarmlm.sim import cli as simulate_cli

logger = logging.getLogger(__name__)


def parse_blocks(text: str) -> tuple[int, int]:
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--blocks takes START:END (e.g. 0:15), not {text!r}") from e
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"--blocks {text}: need 0 <= START < END")
    return start, end


def _add_network_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR", help="multiaddrs of swarm peers")
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on (default: all)")
    parser.add_argument("--port", type=port, default=0, help="TCP port to listen on (default: any free port)")
    parser.add_argument(
        "--swarm-key", default=None, metavar="FILE", help="join (or start) the private swarm of this key file"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="swarmlm", description="Run large language models over a swarm of servers")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a span of a model's blocks")
    serve.add_argument("model", help=f"model name ({DEFAULT_MODEL}), .gguf file or Hugging Face folder")
    span = serve.add_mutually_exclusive_group(required=True)
    span.add_argument("--blocks", type=parse_blocks, metavar="START:END", help="blocks to serve")
    span.add_argument(
        "--num-blocks", type=positive_int, metavar="N",
        help="serve N consecutive blocks where the swarm is weakest (and move)",
    )  # fmt: skip
    serve.add_argument("--new-swarm", action="store_true", help="start a new swarm instead of joining one")
    _add_network_args(serve)
    serve.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MADDR",
                       help="addresses others should dial, e.g. /ip4/203.0.113.7/tcp/31337 behind a port forward "
                       "(default: the listening ones)")  # fmt: skip
    serve.add_argument("--relay", nargs="+", default=[], metavar="MADDR",
                       help="for a server that accepts no inbound connections (behind NAT or a firewall): be "
                       "dialled through these relay peers (full multiaddrs ending in /p2p/<peer id>, e.g. a "
                       "`swarmlm dht` node)")  # fmt: skip
    serve.add_argument("--identity", default=None, metavar="PATH",
                       help="key file that keeps this server's peer id across restarts (created, mode 0600, if "
                       "missing)")  # fmt: skip
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                       help="compute dtype of the blocks (auto: the checkpoint's own, else float32)")  # fmt: skip
    serve.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    serve.add_argument("--dht-prefix", default=None, help="swarm name (default: derived from the model)")
    serve.add_argument("--cache-dir", default=None, help="where converted models are kept (default ~/.cache/swarmlm)")
    serve.add_argument("--max-tokens-per-request", type=positive_int, default=ServerConfig.max_tokens_per_request)
    serve.add_argument("--num-threads", type=positive_int, default=None, help="torch compute threads")
    serve.add_argument(
        "--cache-tokens", type=positive_int, default=None,
        help="KV-cache budget in tokens (default: 1/4 of free memory)",
    )  # fmt: skip
    serve.add_argument(
        "--alloc-timeout",
        type=non_negative,
        default=ServerConfig.alloc_timeout_s,
        help="seconds a session waits for cache room, first come first served (0: do not wait)",
    )
    serve.add_argument("--session-idle-timeout", type=positive, default=ServerConfig.session_idle_timeout_s)
    serve.add_argument(
        "--decode-wait-ms",
        type=non_negative,
        default=ServerConfig.decode_wait_s * 1000,
        help="longest a decode step waits for the steps of other recently active sessions, to share one forward "
        "with them (0: never wait)",
    )
    serve.add_argument(
        "--peer-memory-mb",
        type=positive,
        default=None,
        help="MB of requests one peer may have buffered (default: 4 maximal requests)",
    )
    serve.add_argument("--max-sessions-per-peer", type=positive_int, default=ServerConfig.max_sessions_per_peer)
    serve.add_argument("--max-sessions", type=positive_int, default=ServerConfig.max_sessions,
                       help="sessions of all peers")  # fmt: skip
    serve.add_argument(
        "--peer-cache-share",
        type=fraction,
        default=ServerConfig.peer_cache_share,
        help="fraction of the KV cache one peer may hold",
    )
    serve.add_argument(
        "--write-timeout",
        type=positive,
        default=ServerConfig.write_timeout_s,
        help="seconds a reply may wait for the peer to read it before its stream is closed",
    )
    serve.add_argument(
        "--drain-timeout",
        type=non_negative,
        default=ServerConfig.drain_timeout_s,
        help="seconds open inference sessions may go on when the server leaves or moves (then they are closed)",
    )
    serve.add_argument(
        "--rebalance-interval",
        type=non_negative,
        default=ServerConfig.rebalance_interval_s,
        help="seconds between checks whether a --num-blocks server should move (0: never)",
    )
    serve.add_argument(
        "--balance-quality",
        type=fraction,
        default=ServerConfig.balance_quality,
        help="move when the swarm's bottleneck throughput < this * its bottleneck after the move",
    )
    serve.add_argument("--announce-interval", type=positive, default=ServerConfig.announce_interval_s,
                       help="seconds between refreshes of the DHT record")  # fmt: skip
    serve.add_argument("--record-ttl", type=positive, default=ServerConfig.record_ttl_s,
                       help="seconds a record lives unrefreshed (a crashed server is forgotten then)")  # fmt: skip
    serve.add_argument(
        "--quant", choices=QUANT_MODES, default=None,
        help="store the blocks' Linear weights as int8 (~4x less memory) or nf4 (4-bit, ~7x less; needs "
        "bitsandbytes); announced as that dtype, which clients accept only when their accepted_dtypes include it",
    )  # fmt: skip
    serve.add_argument(
        "--adapters", nargs="+", default=[], metavar="PATH",
        help="PEFT LoRA adapter folders for the served blocks; clients name one by its folder name",
    )  # fmt: skip
    serve.add_argument("--max-frame-mb", type=positive, default=ServerConfig.max_frame_mb,
                       help="largest frame accepted")  # fmt: skip

    dht = sub.add_parser("dht", help="run a bootstrap-only DHT node that others join")
    _add_network_args(dht)
    dht.add_argument(
        "--no-relay", action="store_true", help="do not relay for servers that accept no inbound connections"
    )
    key = sub.add_parser("swarm-key", help="write a new random key for a private swarm")
    key.add_argument("file", help="where to write it (must not exist)")

    demo = sub.add_parser("demo", help="start a local swarm and chat with the bundled model")
    demo.add_argument("--prompt", default="What is the capital of France?", help="what to ask")
    demo.add_argument("--servers", type=positive_int, default=2, help="how many local servers split the model")
    demo.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=64,
        help="longest answer in tokens, in one-shot and chat modes (an answer cut there ends its turn)",
    )
    demo.add_argument("--model", default=DEFAULT_MODEL, help="model to serve and chat with")
    demo.add_argument("--chat", action="store_true", help="chat interactively, keeping one session across turns")
    demo.add_argument("--api", action="store_true", help="serve the OpenAI-compatible API (and monitor) on the swarm")
    demo.add_argument("--api-port", type=port, default=8000, help="HTTP port of --api")
    _add_api_parsers(sub)
    train = sub.add_parser("train", help="tune prompts or LoRA on the shipped sentiment task through a swarm")
    train.add_argument("--model", default=DEFAULT_MODEL, help="model to tune")
    train.add_argument(
        "--initial-peers", nargs="*", default=[], metavar="MADDR", help="use this swarm (default: start one)"
    )
    train.add_argument("--servers", type=positive_int, default=2, help="servers of the local swarm")
    train.add_argument("--tuning-mode", default="deep_ptune", choices=["ptune", "deep_ptune", "lora"])
    train.add_argument("--pre-seq-len", type=positive_int, default=8, help="prompt length (ptune, deep_ptune)")
    train.add_argument("--lora-rank", type=positive_int, default=8, help="LoRA rank (lora)")
    train.add_argument("--lora-alpha", type=positive_int, default=16, help="LoRA scaling is alpha / rank (lora)")
    train.add_argument("--lora-target-modules", nargs="+", default=["q_proj", "v_proj"], metavar="NAME",
                       help="modules of every block LoRA adapts (lora)")  # fmt: skip
    train.add_argument("--steps", type=positive_int, default=30)
    train.add_argument("--batch-size", type=positive_int, default=8)
    train.add_argument("--lr", type=positive, default=None,
                       help="Adam learning rate (default: 3e-3 prompts, 1e-3 lora)")  # fmt: skip
    train.add_argument("--save", default=None, metavar="DIR",
                       help="save the trained prompts, or the LoRA adapter (a PEFT folder), here")  # fmt: skip
    simulate_cli.add_parser(sub)
    return parser


def _add_api_parsers(sub: argparse._SubParsersAction) -> None:
    api = sub.add_parser("api", help="serve an OpenAI-compatible HTTP API (and the monitor page) over a swarm")
    api.add_argument("model", help=f"model name ({DEFAULT_MODEL}), .gguf file or Hugging Face folder")
    api.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs of swarm peers")
    api.add_argument("--host", default="127.0.0.1", help="HTTP interface (default: this machine only)")
    api.add_argument("--port", type=port, default=8000, help="HTTP port (0: any free port)")
    api.add_argument("--served-model-name", default=None, help="the model's name in the API")
    api.add_argument("--dht-prefix", default=None, help="swarm name (default: derived from the model)")
    api.add_argument("--max-concurrent", type=positive_int, default=16,
                     help="requests generating at once (servers allow 16 sessions per peer by default)")  # fmt: skip
    api.add_argument("--missing-blocks-timeout", type=non_negative, default=10.0,
                     help="seconds a request waits for missing blocks before a 503")  # fmt: skip
    monitor = sub.add_parser("monitor", help="serve the swarm monitor page (no API)")
    monitor.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs of peers")
    monitor.add_argument("--host", default="127.0.0.1", help="HTTP interface (default: this machine only)")
    monitor.add_argument("--port", type=port, default=8000, help="HTTP port (0: any free port)")
    status = sub.add_parser("status", help="print the swarm's models, coverage and servers")
    status.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs of peers")


def _api(args: argparse.Namespace) -> None:
    from swarmlm.api.service import ApiOptions, run_api

    run_api(ApiOptions(
        model=args.model, initial_peers=tuple(args.initial_peers), host=args.host, port=args.port,
        served_name=args.served_model_name, dht_prefix=args.dht_prefix, max_concurrent=args.max_concurrent,
        missing_blocks_timeout_s=args.missing_blocks_timeout,
    ))  # fmt: skip


def _monitor(args: argparse.Namespace) -> None:
    from swarmlm.api.service import run_monitor

    run_monitor(tuple(args.initial_peers), args.host, args.port)


def _status(args: argparse.Namespace) -> None:
    from swarmlm.api.service import print_status

    print_status(tuple(args.initial_peers))


def _train(args: argparse.Namespace) -> None:
    from swarmlm.tools.train import TrainOptions, run_training

    run_training(
        TrainOptions(
            model=args.model,
            initial_peers=tuple(args.initial_peers),
            servers=args.servers,
            tuning_mode=args.tuning_mode,
            pre_seq_len=args.pre_seq_len,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            lora_target_modules=tuple(args.lora_target_modules),
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            save_dir=args.save,
        )
    )


def _serve(args: argparse.Namespace) -> None:
    from swarmlm.server.server import Server

    config = ServerConfig(
        model=args.model,
        start_block=args.blocks[0] if args.blocks else 0,
        end_block=args.blocks[1] if args.blocks else 0,
        num_blocks=args.num_blocks,
        initial_peers=tuple(args.initial_peers),
        new_swarm=args.new_swarm,
        host=args.host,
        port=args.port,
        announce_maddrs=tuple(args.announce_maddrs),
        identity_path=args.identity,
        relays=tuple(args.relay),
        dtype=args.dtype,
        device=args.device,
        dht_prefix=args.dht_prefix,
        cache_dir=args.cache_dir,
        max_tokens_per_request=args.max_tokens_per_request,
        num_threads=args.num_threads,
        cache_tokens=args.cache_tokens,
        alloc_timeout_s=args.alloc_timeout,
        session_idle_timeout_s=args.session_idle_timeout,
        decode_wait_s=args.decode_wait_ms / 1000,
        peer_memory_mb=args.peer_memory_mb,
        max_sessions_per_peer=args.max_sessions_per_peer,
        max_sessions=args.max_sessions,
        peer_cache_share=args.peer_cache_share,
        write_timeout_s=args.write_timeout,
        max_frame_mb=args.max_frame_mb,
        drain_timeout_s=args.drain_timeout,
        rebalance_interval_s=args.rebalance_interval,
        balance_quality=args.balance_quality,
        announce_interval_s=args.announce_interval,
        record_ttl_s=args.record_ttl,
        swarm_key=_swarm_key(args),
        adapters=tuple(args.adapters),
        quant=args.quant,
    )
    Server(config).run()


def _swarm_key(args: argparse.Namespace) -> bytes | None:
    from swarmlm.swarm.private import load_swarm_key

    return None if args.swarm_key is None else load_swarm_key(args.swarm_key)


def _new_swarm_key(args: argparse.Namespace) -> None:
    from swarmlm.swarm.private import generate_swarm_key

    try:
        generate_swarm_key(args.file)
    except OSError as e:
        raise SwarmError(f"cannot write a swarm key to {args.file}: {e}") from e
    print(f"Wrote a new swarm key to {args.file}; give it (privately) to every server and client of the swarm")


def _dht(args: argparse.Namespace) -> None:
    from swarmlm.swarm.bootstrap import run_bootstrap

    run_bootstrap(tuple(args.initial_peers), args.host, args.port, _swarm_key(args), relay=not args.no_relay)


def _demo(args: argparse.Namespace) -> None:
    from swarmlm.tools.demo import run_demo

    run_demo(
        prompt=args.prompt,
        num_servers=args.servers,
        max_new_tokens=args.max_new_tokens,
        model=args.model,
        chat=args.chat,
        api_port=args.api_port if args.api else None,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not args.verbose:
        logging.getLogger("hivemind").setLevel(logging.WARNING)
    try:
        commands = {"serve": _serve, "dht": _dht, "demo": _demo, "train": _train, "api": _api, "monitor": _monitor,
                    "status": _status, "swarm-key": _new_swarm_key, "simulate": simulate_cli.run}  # fmt: skip
        check_arguments(args)
        commands[args.command](args)
    except SwarmError as e:
        logger.debug("The error's traceback", exc_info=True)
        print(f"swarmlm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
