"""The docs' examples run as written: every ```python block of README.md and of every page under docs/ runs as a script
against a real local swarm of the bundled SmolLM2, and every `swarmlm ...` line of their ```bash blocks parses."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from swarmlm.api.service import READY_LINE
from swarmlm.cli.main import build_parser
from swarmlm.models.loading import DEFAULT_MODEL
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import running_swarm
from tests.integration.http_process import http_process, run_command

ROOT = Path(__file__).resolve().parents[2]
# the addresses the examples show; the test puts the local swarm's (and API's) real ones in their place
PEER_PLACEHOLDER = "/ip4/127.0.0.1/tcp/41234/p2p/12D3KooW..."
# any shown peer address whose id is elided (e.g. another machine's, /ip4/192.0.2.10/tcp/31337/p2p/12D3KooW...)
PEER_ADDRESS = re.compile(r"/ip[46]/[^/\s\"']+/tcp/\d+/p2p/12D3KooW\.\.\.")
API_PLACEHOLDER = "http://127.0.0.1:8000"
# an HTML comment on the line before a block: <!-- docs-test: skip (why) -->
SKIP_MARK = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<reason>.+)\)\s*-->")
# a few tokens per example on 2 cores, with interpreter start-up and imports: well under a minute each
EXAMPLE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    skip_reason: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def code_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with the skip reason marked just before each (if any)."""
    blocks, lines = [], path.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = re.fullmatch(r"```(\w+)\s*", lines[index])
        if opening is None:
            index += 1
            continue
        end = lines.index("```", index + 1)
        before = next((line for line in reversed(lines[:index]) if line.strip()), "")
        mark = SKIP_MARK.fullmatch(before.strip())
        code = "\n".join(lines[index + 1 : end]) + "\n"
        blocks.append(Block(path, index + 1, opening[1], code, mark["reason"] if mark else None))
        index = end + 1
    return blocks


def blocks_of(language: str) -> list[Block]:
    return [block for path in doc_files() for block in code_blocks(path) if block.language == language]


PYTHON_BLOCKS = blocks_of("python")
RUNNABLE = [block for block in PYTHON_BLOCKS if block.skip_reason is None]


def test_the_docs_have_examples_and_skip_few() -> None:
    # guards the extraction itself: a changed fence style would otherwise leave nothing to run
    assert len(RUNNABLE) >= 5, [block.name for block in PYTHON_BLOCKS]
    skipped = [block for block in PYTHON_BLOCKS if block.skip_reason is not None]
    assert len(skipped) <= len(PYTHON_BLOCKS) // 4, [(block.name, block.skip_reason) for block in skipped]


def test_every_page_of_the_site_is_read() -> None:
    pages = {path.relative_to(ROOT).as_posix() for path in doc_files()}
    assert {"README.md", "docs/index.md", "docs/reference/options.md"} <= pages
    for shown in (PEER_PLACEHOLDER, "/ip4/192.0.2.10/tcp/31337/p2p/12D3KooW..."):
        assert PEER_ADDRESS.fullmatch(shown), shown
    for block in RUNNABLE:  # an example that joins a swarm must show an address the test can replace
        assert "initial_peers" not in block.code or PEER_ADDRESS.search(block.code), block.name


def test_every_python_block_is_a_complete_program(tmp_path: Path) -> None:
    """Skipped blocks too: pyflakes' checks (no undefined name, no unused import) over each block on its own."""
    files = []
    for number, block in enumerate(PYTHON_BLOCKS):
        files.append(tmp_path / f"block_{number}.py")
        files[-1].write_text(block.code)
    ruff = [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F", "--output-format", "concise"]
    result = subprocess.run([*ruff, *map(str, files)], capture_output=True, text=True, timeout=120)
    names = {str(file): block.name for file, block in zip(files, PYTHON_BLOCKS, strict=True)}
    report = "\n".join(
        line.replace(file, names[file]) for line in result.stdout.splitlines() for file in names if file in line
    )
    assert result.returncode == 0, report or result.stdout + result.stderr
    for block in RUNNABLE:
        assert "[...]" not in block.code, f"{block.name}: give INITIAL_PEERS as {PEER_PLACEHOLDER!r}, not [...]"


@pytest.fixture(scope="module")
def swarm(smollm_dir: Path) -> Iterator[LocalSwarm]:
    # served under the model's name, as the examples name it, so that servers and examples share the DHT prefix
    with running_swarm(DEFAULT_MODEL, [(0, 15), (15, 30)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def api_url(swarm: LocalSwarm) -> Iterator[str]:
    args = ["api", DEFAULT_MODEL, "--port", "0", "--initial-peers", *swarm.initial_peers]
    with http_process(args, READY_LINE) as url:
        yield url


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda block: block.name)
def test_python_example_runs(block: Block, swarm: LocalSwarm, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    code = PEER_ADDRESS.sub(swarm.initial_peers[0], block.code)
    if API_PLACEHOLDER in code:
        code = code.replace(API_PLACEHOLDER, request.getfixturevalue("api_url"))
    script = tmp_path / "example.py"
    script.write_text(code)
    # a fresh folder per example (they write prompts and adapters into it), outside the checkout; no HF_HUB_OFFLINE
    # is set for them: only the code they show keeps them off the Hugging Face Hub
    result = run_command([sys.executable, str(script)], timeout=EXAMPLE_TIMEOUT_S, cwd=tmp_path)
    assert result.returncode == 0, f"{block.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert result.stdout.strip(), f"{block.name} printed nothing; its examples show their results"


def cli_lines() -> list[tuple[str, list[str]]]:
    """(where, arguments) of each `swarmlm ...` or `./dev.sh demo ...` command line in the docs' bash blocks."""
    commands = []
    for block in blocks_of("bash"):
        for offset, line in enumerate(block.code.splitlines(), start=1):
            words = shlex.split(line, comments=True)
            if words and words[0].endswith("swarmlm"):
                commands.append((f"{block.path.name}:{block.line + offset}", _fill_ellipses(words[1:])))
            elif words[:2] == ["./dev.sh", "demo"]:
                commands.append((f"{block.path.name}:{block.line + offset}", _fill_ellipses(words[1:])))
    return commands


def _fill_ellipses(words: list[str]) -> list[str]:
    """`...` after an option stands for its value (`--initial-peers ...`); anywhere else, for more options."""
    filled: list[str] = []
    for word in words:
        if word != "...":
            filled.append(word)
        elif filled and filled[-1].startswith("--"):
            filled.append(PEER_PLACEHOLDER)
    return filled


CLI_LINES = cli_lines()


def test_the_docs_show_cli_commands() -> None:
    assert len(CLI_LINES) >= 10 and {args[0] for _, args in CLI_LINES} >= {"serve", "dht", "api", "demo", "train"}


@pytest.mark.parametrize(("where", "args"), CLI_LINES, ids=[where for where, _ in CLI_LINES])
def test_cli_example_parses(where: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: `swarmlm {shlex.join(args)}` does not parse: {capsys.readouterr().err}")
