"""The package's layers: a table of floors that every import must go down (any new upward import fails here); and
the library never imports swarmlm.tools (local swarms, the network test bed, the demo, training), which the CLI's
commands and the API service may import, lazily, inside the function that starts the tooling."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import swarmlm

PACKAGE = Path(swarmlm.__file__).resolve().parent
TOOLS = "swarmlm.tools"
# the places that start tooling on purpose: the CLI's commands (demo, train) and the API service
MAY_START_TOOLING = ("cli/", "api/service.py")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute name `from ... import` reads from, relative levels resolved against the importing module."""
    if node.level == 0:
        return node.module or ""
    anchor = module.split(".")
    # a package's own __init__ is level 1 of itself; a plain module's level 1 is its package
    anchor = anchor if is_package else anchor[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def _is_tools(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".")


def tools_imports(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, bool]]:
    """(line, run at import time) of every import of swarmlm.tools in `source`, the module named `module`."""
    tree = ast.parse(source)
    # an import inside a function runs when it is called; anywhere else (even under `if` or `try`) at import time
    in_function = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Call) and _names_import_function(node.func) and node.args:
            first = node.args[0]
            names = [first.value] if isinstance(first, ast.Constant) and isinstance(first.value, str) else []
        if any(_is_tools(name) for name in names):
            yield node.lineno, id(node) not in in_function


def _names_import_function(func: ast.expr) -> bool:
    """importlib.import_module(...), import_module(...) or __import__(...)."""
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def _library_files() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if not relative.startswith("tools/"):
            yield path


def _found(path: Path) -> list[tuple[int, bool]]:
    return list(tools_imports(path.read_text(), _module_name(path), path.name == "__init__.py"))


# The floors of the package, lowest first: a module may import its own package and anything on a lower floor, never
# a package on its own floor or above (lazily inside a function or under TYPE_CHECKING included). The longest
# matching path names a module's floor.
FLOORS: dict[str, int] = {
    "version": 0, "errors": 0, "utils": 0,  # plain definitions, no swarmlm import
    "checks": 1, "protocol": 1,  # option checks; the wire's messages and codecs
    "models": 2, "net": 2,  # the families' blocks and loading; streams and transport
    "swarm": 3,  # DHT records, identities, routing over announced spans
    "config": 4, "cli/args": 4,  # configs and the command line's own checks (read before heavy imports)
    "client": 5, "server": 5,  # the two sides; neither imports the other
    "__init__": 6, "api": 6, "sim": 6,  # the package's face, the HTTP API, the simulator of the real code
    "tools": 7,  # local swarms, the network test bed, the demo, training
    "cli": 8,  # the `swarmlm` command dispatches to everything
}  # fmt: skip


def _floor_key(module: str) -> str:
    """The FLOORS entry of a swarmlm module: its longest matching path ("__init__" for the package itself)."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    for size in range(len(parts), 0, -1):
        key = "/".join(parts[:size])
        if key in FLOORS:
            return key
    raise AssertionError(f"{module} is on no floor: add its package to FLOORS")


def swarmlm_imports(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, module) of every import of a swarmlm module in `source`, the module named `module`; `from a import b`
    yields a.b when b is a module of the package, else a."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            names = [_submodule(base, alias.name) for alias in node.names]
        elif isinstance(node, ast.Call) and _names_import_function(node.func) and node.args:
            first = node.args[0]
            names = [first.value] if isinstance(first, ast.Constant) and isinstance(first.value, str) else []
        else:
            continue
        for name in names:
            if name == "swarmlm" or name.startswith("swarmlm."):
                yield node.lineno, name


def _submodule(base: str, name: str) -> str:
    """base.name when it is a module or package of swarmlm (a file or folder), else base (a name defined in it)."""
    candidate = PACKAGE.parent.joinpath(*f"{base}.{name}".split("."))
    return f"{base}.{name}" if candidate.with_suffix(".py").is_file() or candidate.is_dir() else base


def is_upward(module: str, target: str) -> bool:
    """Whether `module` importing `target` breaks the floors: another package on the same floor or above."""
    own, key = _floor_key(module), _floor_key(target)
    same_package = key.split("/")[0] == own.split("/")[0] and own != "__init__"
    return not same_package and FLOORS[key] >= FLOORS[own]


def upward_imports(path: Path) -> list[str]:
    module = _module_name(path)
    return [
        f"line {line}: {target} (floor {FLOORS[_floor_key(target)]}, from floor {FLOORS[_floor_key(module)]})"
        for line, target in swarmlm_imports(path.read_text(), module, path.name == "__init__.py")
        if is_upward(module, target)
    ]


def test_no_module_imports_its_own_floor_or_above() -> None:
    checked = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        checked += 1
        upward = upward_imports(path)
        assert not upward, f"swarmlm/{path.relative_to(PACKAGE).as_posix()} imports upward: {upward}"
    assert checked > 100


def test_the_floor_rule_catches_an_upward_import() -> None:
    """The rule itself: imports of a higher floor, of the same floor, lazy ones and type-only ones all count."""
    cases = {
        "from swarmlm.client.model import X": ("swarmlm.server.compute", True),  # same floor, other package
        "from swarmlm.server import compute": ("swarmlm.server.backend", False),  # own package
        "def f():\n    from swarmlm.api.app import Routes": ("swarmlm.client.model", True),  # lazy
        "if TYPE_CHECKING:\n    from swarmlm.config import ClientConfig": ("swarmlm.checks", True),  # type only
        "from swarmlm.errors import SwarmError": ("swarmlm.checks", False),  # downward
        "from swarmlm.cli.args import integer": ("swarmlm.sim.cli", False),  # cli/args is a low floor
        "from swarmlm.cli.main import main": ("swarmlm.tools.prefork", True),  # the rest of cli is the top
    }
    for source, (module, upward) in cases.items():
        targets = [target for _, target in swarmlm_imports(source, module)]
        assert targets, source
        assert any(is_upward(module, target) for target in targets) == upward, source


def test_the_detector_sees_every_form_of_import() -> None:
    sources = {
        "import swarmlm.tools.local_swarm": "swarmlm.client.model",
        "from swarmlm.tools.netbed.hosts import NetBed": "swarmlm.client.model",
        "from swarmlm import tools": "swarmlm.client.model",
        "from ..tools import demo": "swarmlm.client.model",
        "from ..tools.train import run_training": "swarmlm.server.compute",
        "from . import tools": "swarmlm",
        "def f():\n    import importlib\n    return importlib.import_module('swarmlm.tools.demo')": "swarmlm.api.app",
    }
    for source, module in sources.items():
        assert list(tools_imports(source, module, is_package=module == "swarmlm")), source
    lazy = "def f():\n    from swarmlm.tools.demo import run_demo"
    assert list(tools_imports(lazy, "swarmlm.cli.main")) == [(2, False)]
    eager = "try:\n    from swarmlm.tools.demo import run_demo\nexcept ImportError:\n    pass"
    assert list(tools_imports(eager, "swarmlm.cli.main")) == [(2, True)]
    for clean in ("import swarmlm.toolsy", "from swarmlm.client import tools", "from .tools import x"):
        assert not list(tools_imports(clean, "swarmlm.client.model")), clean


def test_the_library_does_not_import_the_tools() -> None:
    checked = 0
    for path in _library_files():
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(MAY_START_TOOLING):
            continue
        checked += 1
        lines = [line for line, _ in _found(path)]
        assert not lines, f"swarmlm/{relative} imports {TOOLS} at line(s) {lines}: the library must not depend on it"
    # the walk reached the library's packages, not an empty folder
    for package in ("client", "server", "swarm", "protocol", "models", "api"):
        assert (PACKAGE / package / "__init__.py").is_file(), package
    assert checked > 50


def test_the_cli_and_api_service_import_the_tools_lazily() -> None:
    """`swarmlm serve` or `swarmlm api` never pay for (or break on) the tooling's imports."""
    users = 0
    for path in _library_files():
        relative = path.relative_to(PACKAGE).as_posix()
        if not relative.startswith(MAY_START_TOOLING):
            continue
        found = _found(path)
        users += bool(found)
        eager = [line for line, top in found if top]
        assert not eager, f"swarmlm/{relative} imports {TOOLS} at module level (line(s) {eager}): import it lazily"
    assert users, "no CLI command starts the tooling any more: update MAY_START_TOOLING"
