"""The `swarmlm` flags that are config fields, made from the fields' metadata (config.Option), and the config values
read back from the parsed flags: a field's help, flag, type and default are written once, in config.py."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import Field, dataclass
from typing import Any, NamedTuple

from swarmlm.cli.args import Parser, integer, number
from swarmlm.config import Option, options


class _FieldDefault:
    def __repr__(self) -> str:
        return "FIELD_DEFAULT"


FIELD_DEFAULT = _FieldDefault()  # a tweak that keeps the field's default (None is a default of its own)


@dataclass(frozen=True)
class Tweak:
    """How one command takes a config field otherwise than its metadata says (e.g. a client command's own default)."""

    default: object = FIELD_DEFAULT
    help: str | None = None
    nargs: str | None = None
    required: bool = False


class ConfigFlag(NamedTuple):
    """A flag (or positional) a command takes for a config field: what the options test and page check against."""

    config: type
    name: str
    option: Option
    tweak: Tweak


def add_config_flags(
    parser: Parser,
    config: type,
    names: Iterable[str] | None = None,
    into: argparse._ActionsContainer | None = None,
    **tweaks: Tweak,
) -> None:
    """Add the flags of the config's fields `names` (default: all its options) to `parser`, or to a group of it
    (`into`), in the fields' order; `tweaks` change how this command takes some of them."""
    described = options(config)
    chosen = list(described) if names is None else list(names)
    unknown = [name for name in [*chosen, *tweaks] if name not in described]
    if unknown:
        raise ValueError(f"{config.__name__} has no options {unknown}")
    for name in chosen:
        config_field, option = described[name]
        tweak = tweaks.get(name, Tweak())
        (into or parser).add_argument(option.flag_for(name), **_flag_settings(config_field, option, tweak))
        parser.config_flags.append(ConfigFlag(config, name, option, tweak))


def _flag_settings(config_field: Field[Any], option: Option, tweak: Tweak) -> dict[str, Any]:
    settings: dict[str, Any] = {"help": tweak.help or option.help}
    if option.positional:
        return settings
    default = config_field.default if tweak.default is FIELD_DEFAULT else tweak.default
    if isinstance(default, bool):
        if default:
            raise ValueError(f"{config_field.name}: a switch turns an option on, so its default must be False")
        return {**settings, "action": "store_true"}
    if tweak.required:
        settings["required"] = True
    else:
        settings["default"] = flag_default(default, option)
    if tweak.nargs or option.nargs:
        settings["nargs"] = tweak.nargs or option.nargs
    if option.allowed is not None:
        settings["type"] = (integer if option.allowed.integer else number)(option.allowed)
    if option.choices is not None:
        settings["choices"] = option.choices
    if option.metavar is not None:
        settings["metavar"] = option.metavar
    return settings


def flag_default(default: object, option: Option) -> object:
    """A field's default as its flag's default: a list for a tuple, in the flag's unit for a scaled number."""
    if isinstance(default, tuple):
        return list(default)
    if isinstance(default, int | float) and option.scale != 1:
        return default * option.scale
    return default


def config_values(config: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of the config's fields that the parsed command line holds (field name -> value in the field's
    unit and type); fields without a flag on the command are left out."""
    values = {}
    for name, (_, option) in options(config).items():
        if not hasattr(args, option.dest_for(name)):
            continue
        value = getattr(args, option.dest_for(name))
        if isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, int | float) and not isinstance(value, bool) and option.scale != 1:
            value = value / option.scale
        values[name] = value
    return values
