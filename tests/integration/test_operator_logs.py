"""What an operator reads: a server's INFO log says start, span, a periodic one-line summary and a drain that counts
what was served, never a line per step; a client whose server dies mid-generation prints nothing on stderr, and its
trace counts the retry and the replay."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import connected_model, running_swarm

IDS = torch.tensor([[1, 2, 3, 4, 5]])
NEW_TOKENS = 20


def summed(log: str) -> tuple[int, int]:
    """Sessions opened and inference steps, summed over the log's one-second summary lines."""
    found = re.findall(r"Last 1 s: (\d+) sessions opened .*?, (\d+) inference steps", log)
    return sum(int(sessions) for sessions, _ in found), sum(int(steps) for _, steps in found)


def test_server_logs_a_summary_and_a_true_drain_count_but_no_step_lines(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SWARMLM_LOG_REQUESTS", raising=False)  # a server as operators start it
    with running_swarm(tiny_model_dir, [(0, 5)], extra_args=["--summary-interval", "1"]) as swarm:
        (server,) = swarm.servers
        with connected_model(tiny_model_dir, swarm) as model:
            for _ in range(2):  # two sessions
                model.generate(IDS, max_new_tokens=NEW_TOKENS, do_sample=False)
        deadline = time.monotonic() + 20
        while summed(server.log_path.read_text()) != (2, 2 * NEW_TOKENS):  # every busy second summarized
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.2)
        busy_lines = server.log_path.read_text().count("Last 1 s: ")
        time.sleep(2.5)
        idle_lines = server.log_path.read_text().count("Last 1 s: ") - busy_lines
        swarm.stop_server(server)
        log = server.log_path.read_text()
    lines = log.splitlines()
    print(f"\n{len(lines)} log lines for {2 * NEW_TOKENS} generated tokens:\n" + log[-2000:])
    assert not [line for line in lines if "inference step blocks=" in line or "inference open" in line], log
    # one line per busy second (a loaded machine may spread the two generations over several), none while idle
    summaries = [line for line in lines if "Last 1 s: " in line]
    assert summed(log) == (2, 2 * NEW_TOKENS), summaries
    assert idle_lines == 0, summaries  # idle seconds add no line
    assert len(summaries) <= 10, summaries
    (drain,) = [line for line in lines if "Shutting down: draining" in line]
    assert f"served 2 sessions with {2 * NEW_TOKENS} steps" in drain, drain
    assert len(lines) < 40


def test_a_failover_that_succeeds_prints_nothing_and_the_trace_counts_it(
    tiny_model_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with running_swarm(tiny_model_dir, [(0, 5), (0, 5)]) as swarm:
        with connected_model(tiny_model_dir, swarm) as model:
            with model.inference_session(max_length=64) as session:
                model.generate(IDS, max_new_tokens=4, do_sample=False)
                assert model.last_trace is not None and session.last_trace is not None
                # the server the session stands on now (a loaded machine may have made it retry on the other)
                (hop,) = session.route
                used = hop.peer_id
                capfd.readouterr()
                swarm.kill(next(server for server in swarm.servers if server.peer_id == used))
                model.generate(None, max_new_tokens=4, do_sample=False)
                trace = model.last_trace
            stderr = capfd.readouterr().err
    assert stderr == "", stderr
    assert trace is not None and trace.kind == "generate"
    assert trace.retries >= 1 and trace.replays >= 1, trace.summary()
