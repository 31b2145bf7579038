"""The network layer stands beneath client, server and API: the server, swarm, protocol and net packages import
nothing from the client (nor net from the server or the API), and the RPC table names exactly the served methods."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import swarmlm
from swarmlm.protocol.service import METHODS, Kind, SpanService, handle_name

PACKAGE = Path(swarmlm.__file__).resolve().parent
# package -> the packages it must never import (at module level or lazily)
FORBIDDEN = {
    "server": ("swarmlm.client",),
    "swarm": ("swarmlm.client",),
    "protocol": ("swarmlm.client",),
    "net": ("swarmlm.client", "swarmlm.server", "swarmlm.api"),
}


def imported_names(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, absolute name) of everything `source` (the module named `module`) imports, anywhere in it; a
    `from a import b` yields both a and a.b, since b may be a module."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            yield node.lineno, base
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    anchor = module.split(".") if is_package else module.split(".")[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(source: str, module: str, forbidden: tuple[str, ...], is_package: bool = False) -> list[str]:
    return [
        f"line {line}: {name}"
        for line, name in imported_names(source, module, is_package)
        if any(_within(name, package) for package in forbidden)
    ]


def _modules(package: str) -> list[Path]:
    return sorted((PACKAGE / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_detector_sees_absolute_relative_and_lazy_imports() -> None:
    client = ("swarmlm.client",)
    for source, module in {
        "import swarmlm.client.streams": "swarmlm.server.push",
        "from swarmlm.client.sequence_manager import dial": "swarmlm.server.push",
        "from swarmlm import client": "swarmlm.server.push",
        "from ..client import span_call": "swarmlm.server.push",
        "def f():\n    from swarmlm.client.streams import PeerStream": "swarmlm.net.info",
    }.items():
        assert violations(source, module, client), source
    assert violations("from . import client", "swarmlm", client, is_package=True)
    for clean in ("import swarmlm.clientele", "from swarmlm.net.streams import PeerStream", "from .client import x"):
        assert not violations(clean, "swarmlm.server.push", client), clean


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_the_package_stays_beneath_its_users(package: str) -> None:
    modules = _modules(package)
    assert modules, f"swarmlm/{package} has no modules: the walk looks in the wrong place"
    for path in modules:
        found = violations(path.read_text(), _module_name(path), FORBIDDEN[package], path.name == "__init__.py")
        assert not found, f"{path.relative_to(PACKAGE)} imports {', '.join(FORBIDDEN[package])}: {found}"


def test_the_rpc_table_names_exactly_the_services_methods() -> None:
    served = {name for name in vars(SpanService) if name.startswith("rpc_")}
    assert set(METHODS) == served
    assert {handle_name(name) for name in METHODS} == {f"SpanService.{name}" for name in served}
    assert {name for name, method in METHODS.items() if method.kind is Kind.STREAM} == {"rpc_inference", "rpc_push"}
    with pytest.raises(KeyError):
        handle_name("rpc_unknown")
