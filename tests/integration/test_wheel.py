"""A user without the checkout: the wheel `python -m build` makes installs into a fresh venv and gives a working
`swarmlm` (its commands, its package data, a demo through a local swarm), imported from that venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# building (sdist, then the wheel from it) and a one-server demo of SmolLM2 on 2 busy cores
BUILD_TIMEOUT_S = 300.0
DEMO_TIMEOUT_S = 400.0


def run(args: list[str | Path], cwd: Path, timeout_s: float = 120.0) -> str:
    """Runs a command as a user would (no checkout on PYTHONPATH); fails with its output unless it succeeds."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    result = subprocess.run(
        [str(arg) for arg in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the sources: the build writes build/ and *.egg-info next to them, and the checkout is
    shared. No isolated build env (it would download setuptools): this environment's setuptools builds it."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # without the library an editable install built in place: the wheel's build compiles its own
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp_path / "dist", source], tmp_path,
        BUILD_TIMEOUT_S)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("swarmlm-*.whl")
    return wheel


def fresh_venv(tmp_path: Path) -> Path:
    """A new venv that sees this environment's installed dependencies but not its (editable) swarmlm.

    Installing torch and the rest again would take minutes and gigabytes; instead a .pth file adds a folder of links
    to every entry of this environment's site-packages except swarmlm's own."""
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    ours = Path(sysconfig.get_paths()["purelib"])
    deps = tmp_path / "deps"
    deps.mkdir()
    for entry in ours.iterdir():
        if not entry.name.startswith(("swarmlm", "__editable__")):
            (deps / entry.name).symlink_to(entry)
    (site_packages,) = (venv / "lib").glob("python3*/site-packages")
    (site_packages / "dependencies.pth").write_text(f"{deps}\n")
    return venv


def test_the_wheel_installs_and_runs_without_the_checkout(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    venv = fresh_venv(tmp_path)
    elsewhere = tmp_path / "elsewhere"  # no sources in the working directory either
    elsewhere.mkdir()
    python, swarmlm = venv / "bin" / "python", venv / "bin" / "swarmlm"
    # pip itself comes from the linked dependencies; it installs into the running venv
    run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", wheel], elsewhere)

    where = run([python, "-c", "import swarmlm; print(swarmlm.__file__)"], elsewhere).strip()
    assert Path(where).is_relative_to(venv), f"swarmlm was imported from {where}, not from the wheel"
    assert "serve" in run([swarmlm, "--help"], elsewhere)
    assert "--blocks" in run([swarmlm, "serve", "--help"], elsewhere)
    assert "--initial-peers" in run([swarmlm, "api", "--help"], elsewhere)
    data = (
        "from swarmlm.api.app import STATIC; from swarmlm.tools.train import DATASET; "
        "print(all(p.is_file() for p in (STATIC / 'index.html', STATIC / 'monitor.js', DATASET)))"
    )
    assert run([python, "-c", data], elsewhere).strip() == "True", "package data is missing from the wheel"
    kernel = "from swarmlm.client import rows_kernel as k; print(k.library_path(), k.kernel() is not None)"
    library, usable = run([python, "-c", kernel], elsewhere).split()
    assert Path(library).is_relative_to(venv) and usable == "True", "the LM head's kernel was not built into the wheel"

    # the whole path from the wheel: a server process, the client, the tokenizer and the LM head's kernel
    answer = run([swarmlm, "demo", "--servers", "1", "--max-new-tokens", "8"], elsewhere, DEMO_TIMEOUT_S)
    assert "Paris" in answer, answer
