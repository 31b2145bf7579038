"""Chaos trials: a client generates or trains while a random server of a replicated swarm is killed, frozen or cut off.

Every server runs on an emulated host of its own (netbed), so that a server can be cut off by taking its host's link
down; the client and the bootstrap node live on host 0. Each trial starts a fresh client, runs one call (greedy
generation, or a forward and backward of deep prompts) and, at a random moment of it, applies one fault to a random
server: SIGKILL (a crash), SIGSTOP of the server and its helper processes (a frozen machine: connections stay open
and nothing answers) or link down (a pulled cable). The result must equal the fault-free call's (token for token;
gradients to float tolerance) within the trial's deadline. Frozen and cut servers come back after the trial; killed
ones are replaced by a new server for the same blocks, so replication holds for the next trial.
"""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from swarmlm import AutoDistributedModelForCausalLM
from swarmlm.errors import SwarmError
from swarmlm.models.loading import load_config
from swarmlm.tools.local_swarm import LocalServer
from swarmlm.tools.netbed.hosts import COMMAND_TIMEOUT_S
from swarmlm.tools.netbed.swarm import NetSwarm

FAULTS = ("kill", "freeze", "cut")
WORKLOADS = ("generate", "train")
# the trials' client: a silent server is pinged after 1 s and failed 1 s later; no call waits longer than 20 s;
# no spot checks (they would double every call and blur which server a fault hit)
CLIENT_OPTIONS: dict[str, Any] = dict(
    request_timeout_s=20.0, liveness_check_s=1.0, ban_base_s=0.5, missing_blocks_timeout_s=30.0,
    verify_probability=0.0, verify_first_requests=0,
)  # fmt: skip
# a trial (its call, the fault and the recovery) that takes longer than this counts as a hang
TRIAL_DEADLINE_S = 60.0
# gradients equal the fault-free call's within this fraction of their largest magnitude (plus a tiny absolute term)
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7
NEW_TOKENS = 16
PROMPT_TOKENS = 8
PRE_SEQ_LEN = 2
# the fault strikes within this fraction of a fault-free call's time after the call began
FAULT_WINDOW = 0.8


@dataclass(frozen=True)
class Trial:
    index: int
    fault: str  # one of FAULTS
    workload: str  # one of WORKLOADS
    pick: float  # in [0, 1): which of the servers the call has used so far (or of all, before any) the fault hits
    delay_s: float  # when the fault strikes, after the call began


@dataclass(frozen=True)
class Outcome:
    trial: Trial
    victim: int  # the server slot the fault hit
    victim_peer: str  # that server's peer id
    identical: bool  # the result equals the fault-free call's
    seconds: float  # the call's time, fault and recovery included
    extra_s: float  # seconds beyond a fault-free call (the time to recover)
    hit: bool  # the client noticed the fault (the victim served its call and was failed)
    error: str = ""  # what went wrong, if anything (an exception, a wrong result, a hang)


class ChaosSwarm(NetSwarm):
    """A NetSwarm whose server slots (one span each) are kept filled; a dead server's host goes to its successor."""

    def __init__(self, model: str, spans: Sequence[tuple[int, int]], **kwargs: Any):
        super().__init__(model, max_servers=len(spans), threads_per_server=1, **kwargs)
        self.host_of: dict[int, int] = {}  # server pid -> index of its host in the bed
        self.slots: list[LocalServer] = []
        try:
            self.slots = self.start_servers(spans)
        except BaseException:
            self.close()
            raise

    def _launch(self, args: list[str], **popen_kwargs: Any) -> subprocess.Popen:
        alive = {self.host_of[s.process.pid] for s in self.servers if s.process.poll() is None}
        free = [index for index in range(1, len(self.bed.hosts)) if index not in alive]
        if not free:
            raise SwarmError("every host of the bed has a live server")
        index = free[0]
        for pid in [pid for pid, host in self.host_of.items() if host == index]:
            relay = self.relays.pop(pid, None)  # the dead server's relay holds the host's port
            if relay is not None:
                relay.kill()
                relay.wait(COMMAND_TIMEOUT_S)
            del self.host_of[pid]
        self.hosts_used = index - 1  # NetSwarm takes the host after the last one used
        process = super()._launch(args, **popen_kwargs)
        self.host_of[process.pid] = index
        return process

    def refill(self) -> None:
        """Start a server for the span of every slot whose server died."""
        dead = [i for i, server in enumerate(self.slots) if server.process.poll() is not None]
        started = [self.add_server(self.slots[i].start, self.slots[i].end, wait=False) for i in dead]
        self.wait_ready(started)
        for i, server in zip(dead, started, strict=True):
            self.slots[i] = server

    def strike(self, fault: str, server: LocalServer) -> Callable[[], None]:
        """Apply `fault` to `server`; returns what undoes it (nothing for a kill: refill() replaces the server)."""
        if fault == "kill":
            self.kill(server)
            return lambda: None
        if fault == "freeze":
            return freeze(server.process.pid)
        if fault == "cut":
            device = self.bed.hosts[self.host_of[server.process.pid]].outer_device
            set_link(device, "down")
            return lambda: set_link(device, "up")
        raise ValueError(f"fault must be one of {FAULTS}, not {fault!r}")


def freeze(pid: int) -> Callable[[], None]:
    """SIGSTOP a process and its descendants (its DHT node, its p2pd); returns what resumes them."""
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for process in tree:
        process.send_signal(signal.SIGSTOP)

    def resume() -> None:
        for process in tree:
            try:
                process.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                continue

    return resume


def set_link(device: str, state: str) -> None:
    subprocess.run(["ip", "link", "set", "dev", device, state], check=True, timeout=COMMAND_TIMEOUT_S)


def plan(num_trials: int, baseline_s: dict[str, float], seed: int) -> list[Trial]:
    """Trials that rotate over fault kinds and workloads (so that a few cover each pair), each with a random moment
    within the fault-free call's time and a random pick of victim."""
    rng = random.Random(seed)
    trials = []
    for index in range(num_trials):
        fault, workload = FAULTS[index % len(FAULTS)], WORKLOADS[(index // len(FAULTS)) % len(WORKLOADS)]
        delay = rng.uniform(0.0, FAULT_WINDOW * baseline_s[workload])
        trials.append(Trial(index, fault, workload, rng.random(), delay))
    return trials


@dataclass(frozen=True)
class Inputs:
    """What every call of a run computes on: a prompt, and for training the prompts' starting values."""

    ids: torch.Tensor  # (1, PROMPT_TOKENS)
    embeddings: torch.Tensor  # (PRE_SEQ_LEN, hidden)
    deep_prompts: torch.Tensor  # (num_blocks, PRE_SEQ_LEN, hidden)

    @classmethod
    def draw(cls, vocab_size: int, hidden_size: int, num_blocks: int, seed: int) -> Inputs:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (1, PROMPT_TOKENS), generator=generator)
        embeddings = torch.randn(PRE_SEQ_LEN, hidden_size, generator=generator) * 0.1
        return cls(ids, embeddings, torch.randn(num_blocks, PRE_SEQ_LEN, hidden_size, generator=generator) * 0.1)


def connect(swarm: NetSwarm, model_dir: str, workload: str) -> Any:
    tuning = dict(tuning_mode="deep_ptune", pre_seq_len=PRE_SEQ_LEN) if workload == "train" else {}
    with swarm.client_side():
        return AutoDistributedModelForCausalLM.from_pretrained(
            model_dir, initial_peers=swarm.initial_peers, **tuning, **CLIENT_OPTIONS
        )


def call(model: Any, workload: str, inputs: Inputs) -> torch.Tensor:
    """The generated ids, or the gradients of the prompts (flattened) of one forward and backward."""
    if workload == "generate":
        with torch.inference_mode():
            return model.generate(inputs.ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    tuning = model.prompt_tuning
    with torch.no_grad():
        tuning.prompt_embeddings.copy_(inputs.embeddings)
        tuning.deep_prompts.copy_(inputs.deep_prompts)
    tuning.zero_grad()
    model(input_ids=inputs.ids, labels=inputs.ids).loss.backward()
    return torch.cat([tuning.prompt_embeddings.grad.flatten(), tuning.deep_prompts.grad.flatten()])


def same(workload: str, result: torch.Tensor, reference: torch.Tensor) -> bool:
    if workload == "generate":
        return result.tolist() == reference.tolist()
    bound = GRAD_RTOL * reference.abs().max().item() + GRAD_ATOL
    return result.shape == reference.shape and (result - reference).abs().max().item() <= bound


def difference(workload: str, result: torch.Tensor | None, reference: torch.Tensor) -> str:
    if result is None or workload == "generate" or result.shape != reference.shape:
        return f"{None if result is None else result.tolist()} instead of {reference.tolist()}"
    return f"max |diff| {(result - reference).abs().max().item():.3g} (largest gradient {reference.abs().max():.3g})"


class Call(threading.Thread):
    """One call on a thread of its own, so that a hung call is noticed and reported instead of hanging the run."""

    def __init__(self, model: Any, workload: str, inputs: Inputs):
        super().__init__(daemon=True, name=f"chaos-{workload}")
        self.model, self.workload, self.inputs = model, workload, inputs
        self.result: torch.Tensor | None = None
        self.error = ""

    def run(self) -> None:
        try:
            self.result = call(self.model, self.workload, self.inputs)
        except Exception as e:  # noqa: BLE001 - reported as the trial's failure
            self.error = f"{type(e).__name__}: {e}"


def reference_run(swarm: NetSwarm, model_dir: str, workload: str, inputs: Inputs) -> tuple[torch.Tensor, float]:
    """The fault-free call's result and seconds (a fresh client, like every trial's)."""
    model = connect(swarm, model_dir, workload)
    try:
        began = time.monotonic()
        result = call(model, workload, inputs)
        return result, time.monotonic() - began
    finally:
        model.close()


def run_trial(
    swarm: ChaosSwarm, model_dir: str, trial: Trial, inputs: Inputs, references: dict[str, tuple[torch.Tensor, float]]
) -> Outcome:
    """One call with one fault, judged against the fault-free call; the swarm is whole again afterwards."""
    model = connect(swarm, model_dir, trial.workload)
    worker = Call(model, trial.workload, inputs)
    heal: Callable[[], None] = lambda: None  # noqa: E731
    began = time.monotonic()
    try:
        worker.start()
        worker.join(trial.delay_s)
        victim = choose_victim(swarm, model, trial.pick)
        heal = swarm.strike(trial.fault, swarm.slots[victim])
        worker.join(max(0.0, TRIAL_DEADLINE_S - (time.monotonic() - began)))
        seconds = time.monotonic() - began
        victim_peer = str(swarm.slots[victim].peer_id)
        hit = model.model.layers.client.manager.health.failed(victim_peer)
    finally:
        heal()
        if not worker.is_alive():
            model.close()  # a hung call keeps its client: closing it under the call could hang too
    swarm.refill()
    reference, baseline_s = references[trial.workload]
    error = worker.error or (f"hung for more than {TRIAL_DEADLINE_S:.0f} s" if worker.is_alive() else "")
    identical = worker.result is not None and same(trial.workload, worker.result, reference)
    if not error and not identical:
        error = f"result differs from the fault-free call: {difference(trial.workload, worker.result, reference)}"
    return Outcome(trial, victim, victim_peer, identical, seconds, max(0.0, seconds - baseline_s), hit, error)


def choose_victim(swarm: ChaosSwarm, model: Any, pick: float) -> int:
    """The slot of a server the call has used so far (a fault there must be recovered from), or of any server
    before the call used one."""
    health = model.model.layers.client.manager.health
    used = [i for i, server in enumerate(swarm.slots) if health.has_measured(str(server.peer_id))]
    pool = used or list(range(len(swarm.slots)))
    return pool[int(pick * len(pool))]


@dataclass(frozen=True)
class Summary:
    fault: str
    trials: int
    identical: int
    hit: int  # trials where the client noticed the fault
    worst_s: float  # the longest call
    worst_extra_s: float  # the most time a fault added to a call (the worst time to recover)


def summarize(outcomes: Sequence[Outcome]) -> list[Summary]:
    rows = []
    for fault in FAULTS:
        mine = [o for o in outcomes if o.trial.fault == fault]
        if mine:
            rows.append(Summary(
                fault, len(mine), sum(o.identical for o in mine), sum(o.hit for o in mine),
                max(o.seconds for o in mine), max(o.extra_s for o in mine),
            ))  # fmt: skip
    return rows


@dataclass
class ChaosRun:
    inputs: Inputs
    references: dict[str, tuple[torch.Tensor, float]]  # workload -> the fault-free call's result and seconds
    outcomes: list[Outcome]


def run_chaos(
    model_dir: str | Path, spans: Sequence[tuple[int, int]], num_trials: int, seed: int,
    report: Callable[[Outcome], None] = lambda outcome: None,
) -> ChaosRun:  # fmt: skip
    """Start a ChaosSwarm over `spans`, take the fault-free references, run `num_trials` trials; all processes and
    network namespaces are gone when this returns."""
    config = load_config(Path(model_dir))
    inputs = Inputs.draw(config.vocab_size, config.hidden_size, config.num_hidden_layers, seed)
    swarm = ChaosSwarm(str(model_dir), spans)
    try:
        references = {w: reference_run(swarm, str(model_dir), w, inputs) for w in WORKLOADS}
        trials = plan(num_trials, {w: r[1] for w, r in references.items()}, seed)
        run = ChaosRun(inputs, references, [])
        for trial in trials:
            run.outcomes.append(run_trial(swarm, str(model_dir), trial, inputs, references))
            report(run.outcomes[-1])
        return run
    finally:
        swarm.close()
