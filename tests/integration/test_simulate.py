"""`swarmlm simulate` end to end: the command writes its report, Markdown and plots, and the same seed gives a
byte-identical report.json (the runs are reproducible, whatever the process's hash seed and however many worker
processes run them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from swarmlm.models.loading import load_config, load_tokenizer
from swarmlm.sim.loopback import StepCosts, predicted_rate
from swarmlm.tools.local_swarm import even_spans
from tests.conftest import connected_model, running_swarm

SWARMLM = [sys.executable, "-m", "swarmlm.cli.main"]
# a small swarm over a few hours, with its outage, under all three placement rules: seconds of CPU
ARGS = ["simulate", "--servers", "40", "--clients", "150", "--hours", "2", "--outage-hour", "1"]


def simulate(out: Path, hash_seed: str, seed: str = "0", jobs: str = "3") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    return subprocess.run([*SWARMLM, *ARGS, "--seed", seed, "--jobs", jobs, "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip


def test_simulate_writes_a_reproducible_report_with_all_three_rules_and_plots(tmp_path: Path) -> None:
    first = simulate(tmp_path / "a", hash_seed="1")  # the three rules in three worker processes
    assert first.returncode == 0, first.stderr[-3000:]
    second = simulate(tmp_path / "b", hash_seed="2", jobs="1")  # one after another in the command's process
    assert second.returncode == 0, second.stderr[-3000:]
    report = (tmp_path / "a" / "report.json").read_bytes()
    assert report == (tmp_path / "b" / "report.json").read_bytes()
    data = json.loads(report)
    assert sorted(data["runs"]) == ["petals", "random", "swarmlm"]
    for name, run in data["runs"].items():
        # random spans over so few servers may leave a block uncovered all along: no tokens, only failures
        assert run["throughput"]["tokens_generated"] > 0 or name == "random"
        assert len(run["series"]["hour"]) == 2 * 3600 // data["scenario"]["sample_s"]
        assert run["coverage"]["outage"]["servers_lost"] > 0
    names = {p.name for p in (tmp_path / "a").iterdir()}
    assert {"report.json", "report.md", "throughput.png", "latency.png", "coverage_swarmlm.png"} <= names
    assert "| mean decode rate, tokens/s |" in (tmp_path / "a" / "report.md").read_text()
    other = simulate(tmp_path / "c", hash_seed="1", seed="1", jobs="1")
    assert other.returncode == 0, other.stderr[-3000:]
    assert (tmp_path / "c" / "report.json").read_bytes() != report


def test_a_run_shorter_than_one_sample_still_writes_its_report_and_plots(tmp_path: Path) -> None:
    """3 simulated minutes, less than the 5-minute sample interval: the coverage plot says there is no sample."""
    command = [
        "simulate",
        "--servers",
        "5",
        "--clients",
        "10",
        "--hours",
        "0.05",
        "--no-compare",
        "--out",
        str(tmp_path),
    ]
    run = subprocess.run([*SWARMLM, *command], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "report.json").read_text())["runs"]["swarmlm"]["series"]["hour"] == []
    assert (tmp_path / "coverage_swarmlm.png").stat().st_size > 0


# the validation: a real loopback swarm of SmolLM2 (2 servers, 8 users at once) against the simulator's prediction
# from step costs measured here, on this machine (one server at 1 and 8 sessions, 2 servers at 1 session). The
# simulator gives every server a machine of its own: two one-thread servers on two cores come close to that, three
# do not (the third waits for a core, which the simulated swarm never does)
NEW_TOKENS = 24
USERS = 8
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
    "What is 12 times 12?", "Who wrote Hamlet?", "What do bees make?", "How many legs has a spider?",
    "What is the boiling point of water?",
]  # fmt: skip


def decode_rate(model: torch.nn.Module, prompts: list[torch.Tensor]) -> float:
    """New tokens/s of all prompts generated greedily at once (a thread each), NEW_TOKENS each."""

    def work(ids: torch.Tensor) -> None:
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[]
            )

    work(prompts[0])  # warm-up: routes, connections and the servers' first steps
    began = time.perf_counter()
    threads = [threading.Thread(target=work, args=(ids,)) for ids in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(prompts) * NEW_TOKENS / (time.perf_counter() - began)


def measured_rates(model_dir: Path, spans: list[tuple[int, int]], prompts: list[torch.Tensor]) -> tuple[float, float]:
    """(1 user's rate, USERS users' aggregate rate) through a real swarm of `spans`."""
    with running_swarm(model_dir, spans) as swarm, connected_model(model_dir, swarm) as model:
        return decode_rate(model, prompts[:1]), decode_rate(model, prompts[:USERS])


@pytest.mark.alone  # a rate measured while other tests load the cores would not be the swarm's
def test_the_simulator_predicts_a_loopback_swarms_decode_rate_within_a_quarter(smollm_dir: Path) -> None:
    tokenizer = load_tokenizer(smollm_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
               for q in QUESTIONS]  # fmt: skip
    blocks = load_config(smollm_dir).num_hidden_layers
    one_1, one_n = measured_rates(smollm_dir, [(0, blocks)], prompts)
    spans = even_spans(blocks, 2)
    two_1, two_n = measured_rates(smollm_dir, spans, prompts)
    # per-token times: 1 / rate for one user; USERS / rate when USERS decode in step
    t1, tn, t2 = 1 / one_1, USERS / one_n, 1 / two_1
    hop_s = max(0.0, t2 - t1)  # one more hop than one server
    block_s = max(1e-6, (t1 - hop_s) / blocks)  # the client's own cost folded in: only sums of these matter here
    slope = max(0.0, (tn - t1) / (blocks * block_s * (USERS - 1)))
    costs = StepCosts(block_s=block_s, batch_slope=slope, hop_s=hop_s, client_s=0.0)
    assert predicted_rate([(0, blocks)], 1, NEW_TOKENS, costs) == pytest.approx(one_1, rel=0.1)  # the calibration
    predicted = predicted_rate(spans, USERS, NEW_TOKENS, costs)
    print(f"measured {two_n:.1f} tokens/s, simulated {predicted:.1f} (1 server: {one_1:.1f} / {one_n:.1f}, "
          f"2 servers: {two_1:.1f})")  # fmt: skip
    assert predicted == pytest.approx(two_n, rel=0.25)
