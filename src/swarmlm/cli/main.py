"""The `swarmlm` command: argparse -> config -> objects. The only place that reads the environment."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from swarmlm.cli.args import Parser, check_arguments, port, positive, positive_int
from swarmlm.cli.flags import Tweak, add_config_flags, config_values
from swarmlm.config import MODEL_HELP, REVISION_HELP, ClientConfig, ServerConfig, options
from swarmlm.errors import SwarmError
from swarmlm.models.constants import DEFAULT_MODEL
from swarmlm.sim import cli as simulate_cli
from swarmlm.version import __version__

logger = logging.getLogger(__name__)


def parse_blocks(text: str) -> tuple[int, int]:
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--blocks takes START:END (e.g. 0:15), not {text!r}") from e
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"--blocks {text}: need 0 <= START < END")
    return start, end


# the ServerConfig options a DHT node takes too
LOG_REQUESTS_VARIABLE = "SWARMLM_LOG_REQUESTS"  # `serve --log-requests` for every server started with it set
NETWORK_OPTIONS = ("new_swarm", "initial_peers", "host", "port", "swarm_key", "identity_path", "reconnect_interval_s")
CLIENT_PEERS = Tweak(required=True)  # api, monitor and status join a swarm, never start one
# the client commands take the key file, as serve and dht do (the config field holds its secret)
JOIN_KEY = Tweak(help="the key file of the private swarm to join (from `swarmlm swarm-key`)")
START_KEY = Tweak(
    help="the key file of a private swarm: the local swarm is started private, or the swarm of --initial-peers joined"
)
# where `swarmlm api` reads its API key when --api-key is not given (an argument shows in `ps`, the environment not)
API_KEY_ENV = "SWARMLM_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="swarmlm", description="Run large language models over a swarm of servers")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument("--version", action="version", version=f"swarmlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    dht = sub.add_parser("dht", help="run a bootstrap-only DHT node that others join")
    add_config_flags(dht, ServerConfig, NETWORK_OPTIONS)
    dht.add_argument(
        "--no-relay", action="store_true", help="do not relay for servers that accept no inbound connections"
    )
    key = sub.add_parser("swarm-key", help="write a new random key for a private swarm")
    key.add_argument("file", help="where to write it (must not exist)")
    _add_demo(sub)
    _add_api_parsers(sub)
    _add_train(sub)
    simulate_cli.add_parser(sub)
    return parser


def _add_serve(sub: argparse._SubParsersAction) -> None:
    # every ServerConfig option is a flag of serve (its fields without one are set from --blocks or left default)
    serve = sub.add_parser("serve", help="serve a span of a model's blocks")
    add_config_flags(serve, ServerConfig, ["model"])
    span = serve.add_mutually_exclusive_group(required=True)
    span.add_argument("--blocks", type=parse_blocks, metavar="START:END", help="blocks to serve")
    add_config_flags(serve, ServerConfig, ["num_blocks"], into=span)
    rest = [name for name in options(ServerConfig) if name not in ("model", "num_blocks")]
    add_config_flags(serve, ServerConfig, rest)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="start a local swarm and chat with the bundled model")
    demo.add_argument("--prompt", default="What is the capital of France?", help="what to ask")
    demo.add_argument("--servers", type=positive_int, default=2, help="how many local servers split the model")
    demo.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=64,
        help="longest answer in tokens, in one-shot and chat modes (an answer cut there ends its turn)",
    )
    demo.add_argument("--model", default=DEFAULT_MODEL, help=f"model to serve and chat with: {MODEL_HELP}")
    demo.add_argument("model_name", nargs="?", default=None, metavar="MODEL",
                      help="the model, as a positional argument (instead of --model)")  # fmt: skip
    demo.add_argument("--revision", default=None, help=REVISION_HELP)
    demo.add_argument("--chat", action="store_true", help="chat interactively, keeping one session across turns")
    demo.add_argument("--api", action="store_true", help="serve the OpenAI-compatible API (and monitor) on the swarm")
    demo.add_argument("--api-port", type=port, default=8000, help="HTTP port of --api")
    add_config_flags(
        demo, ClientConfig, ["swarm_key"], swarm_key=Tweak(help="start the local swarm private, with this key file")
    )


def _add_api_parsers(sub: argparse._SubParsersAction) -> None:
    api = sub.add_parser("api", help="serve an OpenAI-compatible HTTP API (and the monitor page) over a swarm")
    api.add_argument("model", help=MODEL_HELP)
    api.add_argument("--revision", default=None, help=REVISION_HELP)
    # ApiOptions' default: an HTTP request gives up on missing blocks sooner than a library call
    wait = Tweak(default=10.0, help="seconds a request waits for missing blocks before a 503")
    add_config_flags(api, ClientConfig, ["initial_peers", "dht_prefix", "missing_blocks_timeout_s", "swarm_key"],
                     initial_peers=CLIENT_PEERS, missing_blocks_timeout_s=wait, swarm_key=JOIN_KEY)  # fmt: skip
    api.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="requests to /v1/ must send 'Authorization: Bearer KEY'; repeat it for several users, each "
                     f"its key (default: ${API_KEY_ENV}, keys separated by commas; else no key is asked)")  # fmt: skip
    api.add_argument("--cache-budget-tokens", type=positive_int, default=None, metavar="TOKENS",
                     help="session tokens (batch x length) the API's requests may hold on the servers, shared fairly "
                     "by its users (default: what the servers' announced caches let one peer hold)")  # fmt: skip
    api.add_argument("--host", default="127.0.0.1", help="HTTP interface (default: this machine only)")
    api.add_argument("--port", type=port, default=8000, help="HTTP port (0: any free port)")
    api.add_argument("--served-model-name", default=None, help="the model's name in the API")
    api.add_argument("--max-concurrent", type=positive_int, default=16,
                     help="requests generating at once (servers allow 16 sessions per peer by default)")  # fmt: skip
    api.add_argument("--http-timeout", type=positive, default=15.0, help="seconds a client may take to send a "
                     "request's headers, or its body; idle connections close after as long")  # fmt: skip
    monitor = sub.add_parser("monitor", help="serve the swarm monitor page (no API)")
    add_config_flags(
        monitor, ClientConfig, ["initial_peers", "swarm_key"], initial_peers=CLIENT_PEERS, swarm_key=JOIN_KEY
    )
    monitor.add_argument("--host", default="127.0.0.1", help="HTTP interface (default: this machine only)")
    monitor.add_argument("--port", type=port, default=8000, help="HTTP port (0: any free port)")
    status = sub.add_parser(
        "status",
        help="print the swarm's models, coverage and servers; exit code 0: every model complete, "
        "1: blocks missing, 3: no model served, 2: bad arguments or an unreachable swarm",
    )
    add_config_flags(
        status, ClientConfig, ["initial_peers", "swarm_key"], initial_peers=CLIENT_PEERS, swarm_key=JOIN_KEY
    )
    status.add_argument("--json", action="store_true", help="print the monitor's JSON snapshot instead of tables")


def _add_train(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="tune prompts or LoRA on the shipped sentiment task through a swarm")
    train.add_argument("--model", default=DEFAULT_MODEL, help=f"model to tune: {MODEL_HELP}")
    train.add_argument("--revision", default=None, help=REVISION_HELP)
    add_config_flags(train, ClientConfig, ["initial_peers", "swarm_key"], swarm_key=START_KEY,
                     initial_peers=Tweak(nargs="*", help="use this swarm (default: start one)"))  # fmt: skip
    train.add_argument("--servers", type=positive_int, default=2, help="servers of the local swarm")
    train.add_argument("--tuning-mode", default="deep_ptune", choices=["ptune", "deep_ptune", "lora"])
    train.add_argument("--pre-seq-len", type=positive_int, default=8, help="prompt length (ptune, deep_ptune)")
    train.add_argument("--lora-rank", type=positive_int, default=8, help="LoRA rank (lora)")
    train.add_argument("--lora-alpha", type=positive_int, default=16, help="LoRA scaling is alpha / rank (lora)")
    train.add_argument("--lora-target-modules", nargs="+", default=["q_proj", "v_proj"], metavar="NAME",
                       help="modules of every block LoRA adapts (lora)")  # fmt: skip
    train.add_argument("--steps", type=positive_int, default=30)
    train.add_argument("--batch-size", type=positive_int, default=8)
    train.add_argument(
        "--lr", type=positive, default=None, help="Adam learning rate (default: 3e-3 prompts, 1e-3 lora)"
    )
    train.add_argument("--save", default=None, metavar="DIR",
                       help="save the trained prompts, or the LoRA adapter (a PEFT folder), here")  # fmt: skip


def _api(args: argparse.Namespace) -> None:
    from swarmlm.api.service import ApiOptions, run_api

    run_api(ApiOptions(
        model=args.model, initial_peers=tuple(args.initial_peers), host=args.host, port=args.port,
        served_name=args.served_model_name, dht_prefix=args.dht_prefix, max_concurrent=args.max_concurrent,
        missing_blocks_timeout_s=args.missing_blocks_timeout, http_timeout_s=args.http_timeout,
        revision=args.revision, swarm_key=_swarm_key(args), api_keys=api_keys(args.api_key, os.environ),
        cache_budget_tokens=args.cache_budget_tokens,
    ))  # fmt: skip


def api_keys(flags: list[str] | None, environ: dict[str, str] | os._Environ[str]) -> tuple[str, ...]:
    """The API keys: the flags' (checked not empty by cli/args.py), else the environment's, separated by commas (an
    empty variable means none)."""
    keys = flags or environ.get(API_KEY_ENV, "").split(",")
    return tuple(dict.fromkeys(key.strip() for key in keys if key.strip()))


def _monitor(args: argparse.Namespace) -> None:
    from swarmlm.api.service import run_monitor

    run_monitor(tuple(args.initial_peers), args.host, args.port, _swarm_key(args))


def _status(args: argparse.Namespace) -> int:
    from swarmlm.api.status import print_status

    return print_status(tuple(args.initial_peers), _swarm_key(args), args.json)


def _train(args: argparse.Namespace) -> None:
    from swarmlm.tools.train import TrainOptions, run_training

    run_training(
        TrainOptions(
            model=args.model,
            revision=args.revision,
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
            swarm_key_file=args.swarm_key,
        )
    )


def _serve(args: argparse.Namespace) -> None:
    from swarmlm.server.server import Server

    start_block, end_block = args.blocks or (0, 0)
    # the swarm_key flag names a key file; the config holds its secret
    extra = {"start_block": start_block, "end_block": end_block, "swarm_key": _swarm_key(args)}
    if os.environ.get(LOG_REQUESTS_VARIABLE) == "1":  # the test suite's servers: tests read what each one served
        extra["log_requests"] = True
    Server(ServerConfig(**{**config_values(ServerConfig, args), **extra})).run()


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

    run_bootstrap(
        tuple(args.initial_peers), args.host, args.port, _swarm_key(args), relay=not args.no_relay,
        identity_path=args.identity, may_start_alone=args.new_swarm, reconnect_interval_s=args.reconnect_interval,
    )  # fmt: skip


def _demo(args: argparse.Namespace) -> None:
    from swarmlm.tools.demo import run_demo

    run_demo(
        prompt=args.prompt,
        num_servers=args.servers,
        max_new_tokens=args.max_new_tokens,
        model=args.model_name or args.model,
        chat=args.chat,
        api_port=args.api_port if args.api else None,
        revision=args.revision,
        swarm_key_file=args.swarm_key,
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
        code = commands[args.command](args)
    except SwarmError as e:
        logger.debug("The error's traceback", exc_info=True)
        print(f"swarmlm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code if isinstance(code, int) else 0  # status returns its exit code; the other commands None


if __name__ == "__main__":
    sys.exit(main())
