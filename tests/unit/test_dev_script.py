"""`./dev.sh setup` on a first install says what it is doing while pip works (pip runs --quiet: minutes of silence
otherwise). pip is stood in for by a script that takes its time, in a venv folder of the test's own (SWARMLM_VENV)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the stand-in's main install takes this long: the first progress line must come well before it ends
INSTALL_S = 4.0


def fake_venv(folder: Path) -> Path:
    """A venv whose python logs its arguments and sleeps through the main install, as pip would."""
    python = folder / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        f'#!/usr/bin/env bash\necho "$*" >> "{folder}/calls"\ncase "$*" in *" -e ."*) sleep {INSTALL_S} ;; esac\n'
    )
    python.chmod(0o755)
    return folder


def test_a_first_install_shows_progress_while_pip_works(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / "venv")
    env = {**os.environ, "SWARMLM_VENV": str(venv)}
    began = time.monotonic()
    process = subprocess.Popen(
        [str(ROOT / "dev.sh"), "setup"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        first_s = time.monotonic() - began
        rest = process.stdout.read()
        assert process.wait(30) == 0, first + rest
    finally:
        process.kill()
    assert first_s < INSTALL_S / 2, f"nothing printed for {first_s:.1f} s"
    lines = (first + rest).splitlines()
    assert "Installing dependencies into" in first and "a few minutes on a first run" in first
    assert any(line.startswith("[2/3] Installing swarmlm and its dependencies") for line in lines), lines
    assert any(line.startswith("[3/3] Installing the bundled model") for line in lines), lines
    assert any("Dependencies installed in" in line for line in lines), lines
    assert (venv / ".installed").exists()
    # up to date: a second run installs nothing and says nothing
    again = subprocess.run([str(ROOT / "dev.sh"), "setup"], capture_output=True, text=True, env=env, timeout=30)
    assert again.returncode == 0 and again.stdout == again.stderr == ""
