"""One version: what the package says is what pyproject.toml (so the installed distribution) says."""

import tomllib
from importlib import metadata
from pathlib import Path

import swarmlm
from swarmlm.version import __version__


def test_the_package_and_its_distribution_have_one_version() -> None:
    declared = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["version"]
    assert swarmlm.__version__ == __version__ == declared == metadata.version("swarmlm")
