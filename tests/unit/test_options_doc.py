"""The options reference (docs/reference/options.md) is what src/swarmlm/cli/options_doc.py writes from the code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from swarmlm.cli import options_doc
from swarmlm.cli.main import build_parser
from swarmlm.config import ClientConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_page_is_what_the_generator_writes() -> None:
    committed = (ROOT / options_doc.PAGE).read_text()
    assert committed == options_doc.render(), (
        f"{options_doc.PAGE} is out of date with the CLI or ClientConfig: regenerate it with "
        f"`.venv/bin/{options_doc.REGENERATE}` in the checkout and commit it"
    )


def test_every_command_flag_and_client_option_is_on_the_page() -> None:
    page = options_doc.render()
    for name, command in options_doc._subcommands(build_parser()).items():
        assert f"## `swarmlm {name}`" in page
        for action in command._actions:
            for flag in action.option_strings:
                assert f"`{flag}`" in page, f"swarmlm {name} {flag}"
    for field in dataclasses.fields(ClientConfig):
        assert f"| `{field.name}` |" in page, field.name


def test_generator_writes_the_page_where_asked(tmp_path: Path) -> None:
    target = tmp_path / "reference" / "options.md"
    assert options_doc.main([str(target)]) == 0
    assert target.read_text() == options_doc.render()
