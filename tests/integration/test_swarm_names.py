"""One name for a swarm, everywhere: servers started by the bundled model's name (no --dht-prefix), `swarmlm api` by
that name, a client given the converted folder and `swarmlm demo --api` (whose servers get that folder) all meet in
one swarm and answer as the local model does; the monitor's JSON and `swarmlm status` show names, never a path."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from swarmlm.api.service import READY_LINE
from swarmlm.tools.demo import attach_lines
from swarmlm.tools.local_swarm import LocalSwarm
from swarmlm.utils.processes import spawn_bound
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm
from tests.integration.http_process import SWARMLM, http_process, run_command

NAME = "smollm2-135m-instruct"  # as typed in the README's recipe
DISPLAY = "SmolLM2-135M-Instruct"  # what pages show, however the model was named
QUESTION = "What is the capital of France?"
NEW_TOKENS = 8
# the demo starts two servers (each loading and measuring its span) and then its API, on a busy 2-core machine
DEMO_START_TIMEOUT_S = 420.0
# a swarm's monitor shows both servers probed within a few refreshes
MONITOR_DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def reference(smollm_dir: Path) -> torch.nn.Module:
    return load_reference(smollm_dir)


@pytest.fixture(scope="module")
def expected_answer(smollm_dir: Path, reference: torch.nn.Module) -> str:
    """The local model's greedy answer to QUESTION."""
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    messages = [{"role": "user", "content": QUESTION}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = reference.generate(ids["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def swarm(smollm_dir: Path) -> Iterator[LocalSwarm]:
    """Two `swarmlm serve smollm2-135m-instruct` servers (smollm_dir converted the model before they start)."""
    with running_swarm(NAME, [(0, 15), (15, 30)]) as swarm:
        assert swarm.dht_prefix is None  # each server derives the swarm name itself
        yield swarm


@pytest.fixture(scope="module")
def api_url(swarm: LocalSwarm) -> Iterator[str]:
    """`swarmlm api smollm2-135m-instruct --initial-peers ...`, exactly as `swarmlm demo` prints it for attaching."""
    command = shlex.split(attach_lines(NAME, swarm.initial_peers).splitlines()[1])
    assert command[:3] == ["swarmlm", "api", NAME] and "--dht-prefix" not in command
    with http_process([*command[1:], "--port", "0"], READY_LINE) as url:
        yield url


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())


def ask(base_url: str, model: str) -> str:
    """The API's greedy chat answer to QUESTION (an HTTP error, e.g. 503 for a swarm it does not find, raises)."""
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": NEW_TOKENS,
            "temperature": 0}  # fmt: skip
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


def strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def complete_snapshot(base_url: str) -> dict[str, Any]:
    """The monitor's JSON once it shows the model complete (every server probed)."""
    deadline = time.monotonic() + MONITOR_DEADLINE_S
    while True:
        snapshot = get(f"{base_url}/api/v1/swarm")
        if len(snapshot["models"]) == 1 and snapshot["models"][0]["complete"]:
            return snapshot
        assert time.monotonic() < deadline, snapshot
        time.sleep(1.0)


def assert_no_path(snapshot: dict[str, Any], smollm_dir: Path) -> None:
    (model,) = snapshot["models"]
    assert (model["name"], model["dht_prefix"]) == (DISPLAY, NAME)
    # a POSIX path needs a '/': no string of the snapshot has one (peer ids are base58, versions dotted)
    assert [text for text in strings(snapshot) if "/" in text or smollm_dir.name in text] == []


def test_api_named_like_its_servers_answers_as_the_local_model(api_url: str, expected_answer: str) -> None:
    assert [model["id"] for model in get(f"{api_url}/v1/models")["data"]] == [DISPLAY]
    assert ask(api_url, NAME) == expected_answer
    assert ask(api_url, DISPLAY) == expected_answer


def test_monitor_json_and_status_show_names_not_paths(api_url: str, swarm: LocalSwarm, smollm_dir: Path) -> None:
    snapshot = complete_snapshot(api_url)
    assert_no_path(snapshot, smollm_dir)
    assert {row["peer_id"] for row in snapshot["models"][0]["servers"]} == {s.peer_id for s in swarm.servers}
    status = run_command([*SWARMLM, "status", "--initial-peers", *swarm.initial_peers], timeout=120)
    assert status.returncode == 0, status.stderr
    assert f"Model {DISPLAY} (swarm '{NAME}'): 30 blocks, complete" in status.stdout
    for path in (str(smollm_dir), smollm_dir.name, str(Path.home()), ".gguf"):
        assert path not in status.stdout


def test_a_client_given_the_converted_folder_joins_the_same_swarm(
    swarm: LocalSwarm, smollm_dir: Path, reference: torch.nn.Module
) -> None:
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    with connected_model(smollm_dir, swarm) as model, torch.inference_mode():
        served = {record.start for record in model.model.layers.client.manager.servers.values()}
        assert served == {0, 15}
        difference = (model(ids).logits - reference(ids).logits).abs().max().item()
    assert difference <= LOGITS_ATOL


# ------------------------------------------------------------ `swarmlm demo --api`: servers given the converted folder


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[str, list[str]]]:
    """A running `swarmlm demo --api`: (its API's base URL, its output lines so far)."""
    process = spawn_bound(
        [*SWARMLM, "demo", "--api", "--api-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("  curl "):  # the example request comes once the API listens, with its port
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + DEMO_START_TIMEOUT_S
        while not ready.wait(0.5):
            assert process.poll() is None and time.monotonic() < deadline, "\n".join(lines[-40:])
        url = next(line for line in lines if line.startswith(READY_LINE))[len(READY_LINE) :].strip()
        yield url, lines
        assert process.poll() is None, "\n".join(lines[-40:])
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_demo_prints_its_swarm_and_how_to_attach(demo: tuple[str, list[str]]) -> None:
    _, lines = demo
    (ready,) = [line for line in lines if line.startswith("Swarm ready in ")]
    maddrs = ready.split(": ", 1)[1].split()
    assert maddrs and all(maddr.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in maddr for maddr in maddrs)
    attach = lines.index("Attach to this swarm from another terminal while it runs:")
    assert lines[attach + 1 : attach + 3] == attach_lines(NAME, maddrs).splitlines()[1:]


def test_demo_api_and_an_api_attached_by_its_line_answer(
    demo: tuple[str, list[str]], expected_answer: str, smollm_dir: Path
) -> None:
    url, lines = demo
    (curl,) = [line for line in lines if line.startswith("  curl ")]
    assert curl.startswith(f"  curl {url}/v1/chat/completions ") and f'"model": "{DISPLAY}"' in curl
    assert ask(url, DISPLAY) == expected_answer
    assert_no_path(complete_snapshot(url), smollm_dir)
    attach = lines.index("Attach to this swarm from another terminal while it runs:")
    command = shlex.split(lines[attach + 1])
    with http_process([*command[1:], "--port", "0"], READY_LINE) as attached:
        assert ask(attached, NAME) == expected_answer
