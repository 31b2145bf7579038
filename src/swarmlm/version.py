"""The package's version: a module of its own, so that every layer may read it without importing the package root
(whose public names pull in the client). pyproject.toml's `version` says the same (tests/unit/test_version.py)."""

__version__ = "0.1.0"
