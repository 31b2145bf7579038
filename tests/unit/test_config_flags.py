"""The `swarmlm` flags that are config fields come from the fields' metadata: every option is a flag of the commands
that take it, with its default, type and help, and the options page lists it."""

from __future__ import annotations

import argparse

import pytest

from swarmlm.cli import options_doc
from swarmlm.cli.args import Parser
from swarmlm.cli.flags import FIELD_DEFAULT, Tweak, add_config_flags, config_values, flag_default
from swarmlm.cli.main import build_parser
from swarmlm.config import ClientConfig, ServerConfig, options
from swarmlm.errors import ConfigError


def _commands() -> dict[str, Parser]:
    commands = options_doc._subcommands(build_parser())
    return {name: command for name, command in commands.items() if isinstance(command, Parser)}


def _action(command: argparse.ArgumentParser, flag: str) -> argparse.Action:
    matching = [action for action in command._actions if flag in action.option_strings or action.dest == flag]
    assert len(matching) == 1, flag
    return matching[0]


def test_every_server_option_is_a_serve_flag_whose_default_is_the_fields() -> None:
    args = build_parser().parse_args(["serve", "some-model", "--blocks", "0:1"])
    values = config_values(ServerConfig, args)
    assert set(values) == set(options(ServerConfig))  # a field given option metadata becomes a flag of serve
    defaults = ServerConfig(model="some-model")
    for name, value in values.items():
        if name != "model":
            assert value == getattr(defaults, name), name
    assert values["model"] == "some-model"
    assert {flag.name for flag in _commands()["serve"].config_flags} == set(options(ServerConfig))


def test_flags_are_read_back_in_the_fields_units_and_types() -> None:
    line = ["serve", "m", "--num-blocks", "3", "--decode-wait-ms", "50", "--relay", "/ip4/1.2.3.4/tcp/1/p2p/x"]
    line += ["--new-swarm", "--identity", "key", "--dtype", "bfloat16", "--alloc-timeout", "2.5"]
    values = config_values(ServerConfig, build_parser().parse_args(line))
    assert values["decode_wait_s"] == pytest.approx(0.05)  # the flag is in ms, the field in s
    assert values["relays"] == ("/ip4/1.2.3.4/tcp/1/p2p/x",)  # a list on the command line, a tuple in the config
    assert (values["num_blocks"], values["new_swarm"], values["identity_path"]) == (3, True, "key")
    assert (values["dtype"], values["alloc_timeout_s"]) == ("bfloat16", 2.5)
    ServerConfig(**values)  # every value is one the config takes


def test_every_config_flag_has_its_fields_default_help_and_choices() -> None:
    checked = 0
    for name, command in _commands().items():
        for config, field_name, option, tweak in command.config_flags:
            field, _ = options(config)[field_name]
            action = _action(command, option.flag_for(field_name))
            assert action.help == (tweak.help or option.help), (name, field_name)
            assert action.help, (name, field_name)
            if option.positional or tweak.required:
                continue
            default = field.default if tweak.default is FIELD_DEFAULT else tweak.default
            assert action.default == flag_default(default, option), (name, field_name)
            assert action.choices == option.choices, (name, field_name)
            checked += 1
    assert checked >= len(options(ServerConfig))


def test_numeric_flags_refuse_what_their_range_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for field_name, (_, option) in options(ServerConfig).items():
        if option.allowed is None or option.allowed.accepts(-1):
            continue
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["serve", "m", "--blocks", "0:1", option.flag_for(field_name), "-1"])
        assert exited.value.code == 2
        assert f"argument {option.flag_for(field_name)}: must be " in capsys.readouterr().err


def test_a_client_flags_range_is_the_one_the_client_config_checks() -> None:
    # a flag must not take a value that the config it fills refuses (nor the reverse)
    ranged = {name: option.allowed for name, (_, option) in options(ClientConfig).items() if option.allowed}
    assert ranged
    for name, allowed in ranged.items():
        ClientConfig(**{name: allowed.low + 1})
        with pytest.raises(ConfigError, match=name):
            ClientConfig(**{name: allowed.low - 1})


def test_every_client_field_is_an_option_with_help() -> None:
    # the client's options are from_pretrained's keywords: each one is described on the options page
    described = options(ClientConfig)
    assert list(described) == list(ClientConfig.__dataclass_fields__)
    assert all(option.help for _, option in described.values())


def test_the_options_page_lists_every_option_with_its_help() -> None:
    page = options_doc.render()
    for name, command in _commands().items():
        section = page.split(f"## `swarmlm {name}`")[1].split("\n## ")[0]
        for _, field_name, option, tweak in command.config_flags:
            flag = option.flag_for(field_name)
            assert f"| `{flag}` |" in section, (name, flag)
            assert options_doc._cell(tweak.help or option.help) in section, (name, flag)
    client = page.split("## Client options")[1]
    for field_name, (_, option) in options(ClientConfig).items():
        assert f"| `{field_name}` |" in client
        assert options_doc._cell(option.help) in client


def test_a_command_cannot_name_a_field_that_is_not_an_option() -> None:
    parser = Parser(prog="x")
    with pytest.raises(ValueError, match=r"ServerConfig has no options \['request_timeout_s'\]"):
        add_config_flags(parser, ServerConfig, ["request_timeout_s"])
    with pytest.raises(ValueError, match=r"ClientConfig has no options \['port'\]"):
        add_config_flags(parser, ClientConfig, ["initial_peers"], port=Tweak(default=1))
