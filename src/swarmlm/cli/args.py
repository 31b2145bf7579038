"""Checks of the `swarmlm` command line that run before anything heavy is imported or started: one-line parse
errors, numeric flags with their ranges, and what argparse cannot check alone (addresses, files, free ports)."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from swarmlm.checks import (
    PORT,
    POSITIVE,
    POSITIVE_INT,
    Range,
    check_can_listen,
    check_ip_host,
    check_peer_maddrs,
    check_private_file,
)
from swarmlm.errors import ConfigError
from swarmlm.models.constants import ADAPTER_CONFIG, DEFAULT_MODEL, KNOWN_MODELS
from swarmlm.models.hub import parse_hub_name

if TYPE_CHECKING:
    from swarmlm.cli.flags import ConfigFlag

T = TypeVar("T", int, float)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (the usage is one --help away); they exit with code 2. It keeps
    which of its flags are config fields (cli/flags.py), for the options page and its tests."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config_flags: list[ConfigFlag] = []

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@functools.cache  # one parser per range: the flags of a range share it
def integer(allowed: Range) -> Callable[[str], int]:
    """An argparse type: an integer within `allowed`."""
    return _within(int, allowed)


@functools.cache
def number(allowed: Range) -> Callable[[str], float]:
    """An argparse type: a finite number within `allowed`."""
    return _within(float, allowed)


def _within(convert: Callable[[str], T], allowed: Range) -> Callable[[str], T]:
    def parse(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not allowed.accepts(value):
            raise argparse.ArgumentTypeError(f"must be {allowed.describe()}, not {text!r}")
        return value

    RANGES[parse] = allowed
    return parse


RANGES: dict[object, Range] = {}  # the range each numeric flag type takes (for the options page)


# the argparse types of the hand-written numeric flags (a config field's flag gets its type from its range)
positive_int = integer(POSITIVE_INT)
port = integer(PORT)
positive = number(POSITIVE)


def check_arguments(args: argparse.Namespace) -> None:
    """Raise ConfigError (or SwarmError) on the first problem a parsed command line shows without a model or a
    network: malformed peer addresses, missing files, ports another process listens on."""
    if getattr(args, "model", None) is not None:
        _check_model(args.model)
    peers = getattr(args, "initial_peers", None)
    if peers:
        check_peer_maddrs(peers, "--initial-peers")
    if getattr(args, "swarm_key", None) is not None:
        _check_file(args.swarm_key, "--swarm-key")
    check = _COMMAND_CHECKS.get(args.command)
    if check is not None:
        check(args)


def _check_model(model: str) -> None:
    # only a path or a repository id can be checked without the model loader (known names have neither a slash nor
    # .gguf); whether the Hub has the repository is for the loader to ask
    looks_like_path = "/" in model or model.lower().endswith(".gguf")
    if looks_like_path and not Path(model).expanduser().exists() and parse_hub_name(model) is None:
        raise ConfigError(f"model {model}: no such file or folder, nor a Hub repository ORG/NAME (a model is a Hub "
                          f"repository, a known name such as {DEFAULT_MODEL}, a .gguf file or a Hugging Face "
                          "folder)")  # fmt: skip
    if not looks_like_path and model.lower() not in KNOWN_MODELS and not Path(model).expanduser().exists():
        # a plain word is a known name or a folder here: refused now, not after seconds of imports
        raise ConfigError(f"model {model}: not a known model name ({', '.join(KNOWN_MODELS)}), nor a file or folder "
                          "here, nor a Hub repository ORG/NAME")  # fmt: skip


def _check_file(path: str, flag: str) -> None:
    if not Path(path).expanduser().exists():
        raise ConfigError(f"{flag} {path}: no such file")
    if not Path(path).expanduser().is_file():
        raise ConfigError(f"{flag} {path}: not a file")


def _check_serve(args: argparse.Namespace) -> None:
    for folder in args.adapters:
        if not Path(folder).expanduser().is_dir():
            raise ConfigError(f"--adapters {folder}: no such folder")
        if not (Path(folder).expanduser() / ADAPTER_CONFIG).is_file():
            raise ConfigError(f"--adapters {folder}: no {ADAPTER_CONFIG} there (not a PEFT adapter folder)")
    if args.identity is not None:
        identity = Path(args.identity).expanduser()
        if identity.exists():  # its contents are read with the key parser (swarm/keyfile.py), which costs seconds
            check_private_file(identity, "--identity")
        elif any(parent.exists() and not parent.is_dir() for parent in identity.parents):
            raise ConfigError(f"--identity {args.identity}: a part of the path is a file, not a folder")
    if args.record_ttl <= args.announce_interval:
        # the record would lapse between two refreshes: clients would lose the server every announce interval
        raise ConfigError(f"--record-ttl ({args.record_ttl:g} s) must be longer than --announce-interval "
                          f"({args.announce_interval:g} s)")  # fmt: skip
    _check_p2p_listen(args)


def _check_p2p_listen(args: argparse.Namespace) -> None:
    check_ip_host(args.host)
    check_can_listen(args.host, args.port)


def _check_http_listen(args: argparse.Namespace) -> None:
    check_can_listen(args.host, args.port)


def _check_api(args: argparse.Namespace) -> None:
    if any(not key.strip() for key in args.api_key or []):
        raise ConfigError("--api-key: empty; give a key, or leave the flag out to ask none")
    _check_http_listen(args)


def _check_demo(args: argparse.Namespace) -> None:
    if args.model_name is not None:
        if args.model != DEFAULT_MODEL:
            raise ConfigError(f"two models given: {args.model_name} and --model {args.model}; give one")
        _check_model(args.model_name)
    if args.api:  # the demo's API listens on 127.0.0.1 (demo.py), once its swarm has started: checked before that
        check_can_listen("127.0.0.1", args.api_port, "--api-port")


def _check_train(args: argparse.Namespace) -> None:
    if args.save is not None and Path(args.save).expanduser().exists() and not Path(args.save).expanduser().is_dir():
        # checked now: the prompts or the adapter are saved only after the whole training
        raise ConfigError(f"--save {args.save}: a file is there; name a folder (made if missing)")


_COMMAND_CHECKS: dict[str, Callable[[argparse.Namespace], None]] = {
    "serve": _check_serve,
    "dht": _check_p2p_listen,
    "api": _check_api,
    "monitor": _check_http_listen,
    "demo": _check_demo,
    "train": _check_train,
}
