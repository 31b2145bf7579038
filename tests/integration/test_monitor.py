"""The swarm monitor of a live 3-server swarm: its page in headless Chromium, its JSON and `swarmlm status`; a server
killed mid-way shows as a gap. Screenshots are saved under artifacts/."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmlm.api.service import MONITOR_READY_LINE
from swarmlm.api.status import STATUS_MISSING_BLOCKS, STATUS_NO_MODEL
from swarmlm.swarm.dht import start_dht, visible_maddrs
from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import running_swarm
from tests.integration.http_process import SWARMLM, http_process, run_command

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
SPANS = [(0, 2), (2, 4), (4, 5)]
# the page refreshes every 2 s and a probe of a dead server gives up after 2 s: the gap shows well within this
GAP_DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(tiny_model_dir, SPANS) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def monitor_url(swarm: LocalSwarm) -> Iterator[str]:
    with http_process(["monitor", "--port", "0", "--initial-peers", *swarm.initial_peers], MONITOR_READY_LINE) as url:
        yield url


@pytest.fixture(scope="module")
def page(monitor_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `./dev.sh setup` installs it (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, args=CHROMIUM_ARGS,
            headless=True, viewport={"width": 1200, "height": 800},
        )  # fmt: skip
        try:
            page = browser.new_page()
            page.goto(f"{monitor_url}/")
            yield page
        finally:
            browser.close()


def snapshot(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/api/v1/swarm", timeout=30) as response:
        return json.loads(response.read())


def server_rows(page: Any) -> list[list[str]]:
    return page.eval_on_selector_all(
        ".model tbody tr", "rows => rows.map(r => Array.from(r.cells).map(c => c.textContent))"
    )


def test_json_lists_the_model_its_coverage_and_servers(monitor_url: str, swarm: LocalSwarm) -> None:
    deadline = time.monotonic() + 30
    while len(models := snapshot(monitor_url)["models"]) == 0 or len(models[0]["servers"]) < 3:
        assert time.monotonic() < deadline, models
        time.sleep(0.5)
    (model,) = models
    assert model["num_blocks"] == 5 and model["complete"] and model["missing_blocks"] == []
    assert [block["servers"] for block in model["blocks"]] == [1] * 5
    assert {(s["start"], s["end"]) for s in model["servers"]} == set(SPANS)
    assert {s["peer_id"] for s in model["servers"]} == {server.peer_id for server in swarm.servers}
    assert all(s["state"] == "online" and s["last_seen_s"] is not None and s["version"] for s in model["servers"])


def test_status_prints_the_same_as_a_table(swarm: LocalSwarm) -> None:
    result = run_command([*SWARMLM, "status", "--initial-peers", *swarm.initial_peers], timeout=120)
    assert result.returncode == 0, result.stderr
    assert "5 blocks, complete" in result.stdout and "coverage [=====]" in result.stdout
    for server in swarm.servers:
        assert f"...{server.peer_id[-6:]}" in result.stdout
    assert result.stdout.count("online") == 3


def status(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    began = time.perf_counter()
    result = run_command([*SWARMLM, "status", *args], timeout=120, env={**os.environ, **env} if env else None)
    return result, time.perf_counter() - began


def test_status_json_is_the_snapshot_and_imports_no_model_code(swarm: LocalSwarm) -> None:
    """`status` is a quick look: it reads the swarm without the model code (transformers and the client's model made
    it take 10-13 s instead of ~3 on an idle 2-core machine)."""
    result, took = status("--json", "--initial-peers", *swarm.initial_peers, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert result.returncode == 0, result.stderr
    (model,) = json.loads(result.stdout)["models"]
    assert model["complete"] and {(s["start"], s["end"]) for s in model["servers"]} == set(SPANS)
    print(f"\nswarmlm status took {took:.1f} s")
    # python -X importtime's lines on stderr: "import time: self | cumulative | module"
    lines = result.stderr.splitlines()
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time")}
    assert "swarmlm.api.monitor" in imported  # the lines were read
    assert not imported & {"transformers", "swarmlm.client.model", "swarmlm.api.engine"}


def test_status_exit_code_says_blocks_are_missing_or_no_model_is_served(tiny_model_dir: Path) -> None:
    with running_swarm(tiny_model_dir, [(0, 2)]) as partial:
        result, _ = status("--initial-peers", *partial.initial_peers)
        assert result.returncode == STATUS_MISSING_BLOCKS, result.stderr
        assert "MISSING blocks 2-4" in result.stdout
        result, _ = status("--json", "--initial-peers", *partial.initial_peers)
        assert result.returncode == STATUS_MISSING_BLOCKS and json.loads(result.stdout)["models"][0][
            "missing_blocks"
        ] == [2, 3, 4]
    empty = start_dht(host="127.0.0.1", nat_traversal=False)
    try:
        result, _ = status("--initial-peers", *visible_maddrs(empty))
        assert result.returncode == STATUS_NO_MODEL and "No model is served" in result.stdout, result.stderr
    finally:
        empty.shutdown()


def test_page_shows_three_servers_then_the_gap_of_a_killed_one(page: Any, swarm: LocalSwarm) -> None:
    page.wait_for_function("document.querySelectorAll('.model tbody tr').length === 3", timeout=30_000)
    page.wait_for_function("document.querySelector('.coverage-state')?.textContent === 'complete'", timeout=30_000)
    assert page.locator(".bar .cell").count() == 5 and page.locator(".bar .cell.gap").count() == 0
    assert sorted(row[1] for row in server_rows(page)) == ["0:2", "2:4", "4:5"]
    assert all(row[2] == "online" for row in server_rows(page))
    page.screenshot(path=str(ARTIFACTS / "monitor-complete.png"), full_page=True)

    victim = next(server for server in swarm.servers if (server.start, server.end) == (2, 4))
    swarm.kill(victim)
    killed = time.monotonic()
    page.wait_for_function("document.querySelectorAll('.bar .cell.gap').length === 2", timeout=GAP_DEADLINE_S * 1000)
    shown_after = time.monotonic() - killed
    gaps = page.eval_on_selector_all(".bar .cell.gap", "cells => cells.map(c => c.dataset.block)")
    assert gaps == ["2", "3"]
    assert page.locator(".coverage-state").text_content() == "missing blocks 2-3"
    states = {row[1]: row[2] for row in server_rows(page)}
    assert states == {"0:2": "online", "2:4": "unreachable", "4:5": "online"}
    page.screenshot(path=str(ARTIFACTS / "monitor-gap.png"), full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})  # a phone
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    page.screenshot(path=str(ARTIFACTS / "monitor-phone.png"), full_page=True)
    print(f"\nthe gap showed {shown_after:.1f} s after the kill; screenshots in {ARTIFACTS}")
