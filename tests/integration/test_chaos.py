"""Chaos in small: each fault (SIGKILL, SIGSTOP of a server and its helpers, its host's link down) strikes a server
of a replicated swarm of emulated hosts at a random moment of greedy generation and of a forward and backward of deep
prompts; every result equals the fault-free call's (and generation the local model's), every trial ends within its
deadline, and no process or namespace is left behind."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import psutil
import pytest
import torch

from swarmlm.tools.chaos import FAULTS, NEW_TOKENS, TRIAL_DEADLINE_S, WORKLOADS, run_chaos, summarize
from swarmlm.tools.netbed import hosts
from tests.conftest import descendants, load_reference

pytestmark = pytest.mark.skipif(hosts.unavailable() is not None, reason=str(hosts.unavailable()))

# blocks 0:2 and 2:5 of the 5-block tiny model, two servers each: any one server may fail
SPANS = [(0, 2), (0, 2), (2, 5), (2, 5)]


def test_faults_at_random_moments_change_no_result(tiny_model_dir: Path) -> None:
    before = {process.pid for process in descendants()}
    run = run_chaos(tiny_model_dir, SPANS, num_trials=2 * len(FAULTS), seed=3)
    failures = [(outcome.trial, outcome.error) for outcome in run.outcomes if outcome.error]
    assert failures == []
    assert {(o.trial.fault, o.trial.workload) for o in run.outcomes} == set(itertools.product(FAULTS, WORKLOADS))
    assert all(o.identical and o.seconds < TRIAL_DEADLINE_S for o in run.outcomes)
    assert [row.identical for row in summarize(run.outcomes)] == [2, 2, 2]
    # faults strike servers the call is using: most of them must have been noticed and recovered from
    assert sum(o.hit for o in run.outcomes) >= len(run.outcomes) // 2, run.outcomes
    with torch.inference_mode():
        local = load_reference(tiny_model_dir).generate(
            run.inputs.ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    assert run.references["generate"][0].tolist() == local.tolist()
    _, alive = psutil.wait_procs([p for p in descendants() if p.pid not in before], timeout=10)
    assert alive == []
    assert [name for name in hosts.bed_namespaces() if name.startswith(f"swlm{os.getpid()}x")] == []
