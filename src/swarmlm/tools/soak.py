"""Soak: a swarm run for a long time under churn, with clients generating and training all along.

Servers choose their blocks (`--num-blocks`) and rebalance; a rotation of events (a crash by SIGKILL, a join, a drain
by SIGTERM, a join) keeps their number between a floor and a ceiling. Generating clients compare every answer with a
local run of the same weights; a call that fails while the live servers cover every block is a session lost for good.
The RSS and open file descriptors of every server (with its DHT node and p2pd) are sampled all along.
"""

from __future__ import annotations

import logging
import math
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers import AutoModelForCausalLM

from swarmlm import AutoDistributedModelForCausalLM
from swarmlm.models.loading import load_config
from swarmlm.tools import prefork
from swarmlm.tools.local_swarm import SERVING_LINE, LocalServer, LocalSwarm

logger = logging.getLogger(__name__)

# short periods, so that records of dead servers expire and servers move within seconds, not minutes
SERVER_ARGS = ("--rebalance-interval", "10", "--announce-interval", "2", "--record-ttl", "6", "--drain-timeout", "5")
# the clients: a silent server is failed within seconds; a block without a server is waited for up to 60 s
CLIENT_OPTIONS: dict[str, Any] = dict(request_timeout_s=30.0, liveness_check_s=2.0, missing_blocks_timeout_s=60.0)
# the events' rotation: the swarm loses a server and regains one, twice per cycle
EVENTS = ("crash", "join", "drain", "join")
NEW_TOKENS = 12
PROMPT_TOKENS = 6
NUM_PROMPTS = 8
PRE_SEQ_LEN = 2
# the share of blocks each server holds: with the floor of servers, two may go and the rest still cover every block
BLOCK_SHARE = 0.6


@dataclass(frozen=True)
class SoakPlan:
    minutes: float = 60.0  # how long the churn and the clients run
    clients: int = 8  # generating clients (one more trains deep prompts)
    event_interval_s: float = 30.0  # seconds between churn events
    sample_interval_s: float = 5.0  # seconds between samples of the servers' RSS and descriptors
    min_servers: int = 3  # no server leaves below this many
    seed: int = 0
    # the first servers started never crash or drain (they may still move): their samples span the whole run, so
    # growth over the run shows on them (the others live minutes)
    anchors: int = 1


@dataclass
class Tally:
    """What the clients saw; updated by their threads under `lock`."""

    tokens: int = 0  # tokens generated
    wrong_tokens: int = 0  # tokens that differ from the local run's
    calls: int = 0  # generate() calls that ended
    lost: list[str] = field(default_factory=list)  # calls failed while the live servers covered every block
    uncovered: int = 0  # calls failed while some block had no live server
    train_steps: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class Sample:
    t_s: float  # seconds since the start
    server: str  # "s<index>" in start order
    pid: int
    rss_mb: float  # the server process alone
    fds: int
    tree_rss_mb: float  # the server with its DHT node and p2pd
    tree_fds: int


class Churn:
    """The swarm, its events and what is known of each server (ready, leaving)."""

    def __init__(self, swarm: LocalSwarm, num_blocks: int, plan: SoakPlan):
        self.swarm, self.num_blocks, self.plan = swarm, num_blocks, plan
        self.per_server = max(1, math.ceil(BLOCK_SHARE * num_blocks))
        self.leaving: set[int] = set()  # pids sent SIGTERM or SIGKILL
        self.events: list[tuple[float, str, str]] = []  # (t_s, event, server)
        self.rng = random.Random(plan.seed)

    def live(self) -> list[LocalServer]:
        return [s for s in self.swarm.servers if s.process.poll() is None and s.process.pid not in self.leaving]

    def covered(self) -> bool:
        """Whether the ready servers that are not leaving hold every block."""
        held = {b for s in self.live() if s._ready.is_set() for b in range(s.start, s.end)}
        return held >= set(range(self.num_blocks))

    def join(self, wait: bool = True) -> LocalServer:
        return self.swarm.add_server(num_blocks=self.per_server, extra_args=SERVER_ARGS, wait=wait)

    def step(self, index: int, t_s: float) -> None:
        event = EVENTS[index % len(EVENTS)]
        live = self.live()
        anchors = self.swarm.servers[: self.plan.anchors]
        may_leave = [s for s in live if s not in anchors]
        if event != "join" and (len(live) <= self.plan.min_servers or not may_leave):
            event = "join"
        if event == "join":
            server = self.join(wait=False)  # it counts towards coverage once ready; sampling goes on meanwhile
        else:
            server = self.rng.choice(may_leave)
            self.leaving.add(server.process.pid)
            server.process.send_signal(signal.SIGKILL if event == "crash" else signal.SIGTERM)
        self.events.append((t_s, event, f"s{self.swarm.servers.index(server)}"))

    def moves(self) -> int:
        """Span changes after the first span of every server so far (read from their logs)."""
        return sum(max(0, server_log(s).count(SERVING_LINE) - 1) for s in self.swarm.servers)


def server_log(server: LocalServer) -> str:
    try:
        return server.log_path.read_text(errors="replace")
    except OSError:
        return ""


def sample(swarm: LocalSwarm, t_s: float) -> list[Sample]:
    rows = []
    for index, server in enumerate(swarm.servers):
        if server.process.poll() is not None:
            continue
        try:
            root = psutil.Process(server.process.pid)
            tree = [root, *root.children(recursive=True)]
            rss = [p.memory_info().rss / 2**20 for p in tree]
            fds = [p.num_fds() for p in tree]
        except psutil.Error:
            continue  # it died between the check and the reading
        if rss[0] == 0 or fds[0] == 0:
            continue  # it is exiting: the kernel has freed its memory or closed its descriptors, no pid reaped yet
        rows.append(Sample(t_s, f"s{index}", server.process.pid, rss[0], fds[0], sum(rss), sum(fds)))
    return rows


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (t_s, value) points, per hour."""
    n = len(points)
    mean_t, mean_v = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return 0.0 if var == 0 else cov / var * 3600


@dataclass(frozen=True)
class Growth:
    server: str
    samples: int  # samples after its warm-up
    rss_mb_per_h: float
    fds_per_h: float
    tree_rss_mb_per_h: float
    tree_fds_per_h: float


def growth(samples: Sequence[Sample], warmup_s: float, min_samples: int = 4) -> list[Growth]:
    """Per server, the slopes of its samples taken more than warmup_s after its first one."""
    rows = []
    for server in sorted({s.server for s in samples}, key=lambda name: int(name[1:])):
        mine = [s for s in samples if s.server == server]
        late = [s for s in mine if s.t_s - mine[0].t_s >= warmup_s]
        if len(late) < min_samples:
            continue
        rss, fds, tree_rss, tree_fds = (
            slope_per_hour([(s.t_s, getattr(s, name)) for s in late])
            for name in ("rss_mb", "fds", "tree_rss_mb", "tree_fds")
        )
        rows.append(Growth(server, len(late), rss, fds, tree_rss, tree_fds))
    return rows


def prompts(vocab_size: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (1, PROMPT_TOKENS), generator=generator) for _ in range(NUM_PROMPTS)]


def local_answers(model_dir: Path, inputs: Sequence[torch.Tensor]) -> list[list[int]]:
    """Greedy answers of a local run of the same weights (the attention implementation the servers run)."""
    attention = load_config(model_dir)._attn_implementation
    local = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attention, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            local.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
            for ids in inputs
        ]


def generate_loop(model: Any, inputs: Sequence[torch.Tensor], answers: Sequence[list[int]], churn: Churn,
                  tally: Tally, stop: threading.Event, first: int) -> None:  # fmt: skip
    """Generate answers to the prompts in turn (from the `first`) until stopped; count tokens, wrong tokens, losses."""
    turn = first
    while not stop.is_set():
        ids, expected = inputs[turn % len(inputs)], answers[turn % len(inputs)]
        turn += 1
        try:
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        except Exception as e:  # noqa: BLE001 - counted: the soak's point is that none happen while blocks are covered
            record_failure(tally, churn, f"{type(e).__name__}: {e}")
            continue
        got = out[0].tolist()
        with tally.lock:
            tally.calls += 1
            tally.tokens += len(got) - ids.shape[1]
            tally.wrong_tokens += sum(a != b for a, b in zip(got, expected, strict=True))


def record_failure(tally: Tally, churn: Churn, error: str) -> None:
    covered = churn.covered()
    with tally.lock:
        if covered:
            tally.lost.append(error)
        else:
            tally.uncovered += 1
    logger.warning("a call failed (%s): %s", "blocks covered" if covered else "blocks uncovered", error)


def train_loop(model: Any, ids: torch.Tensor, churn: Churn, tally: Tally, stop: threading.Event) -> None:
    """Adam steps of deep prompt tuning on one batch until stopped."""
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    while not stop.is_set():
        try:
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        except Exception as e:  # noqa: BLE001 - counted like a generating client's failure
            record_failure(tally, churn, f"training: {type(e).__name__}: {e}")
            continue
        with tally.lock:
            tally.train_steps += 1


@dataclass
class SoakReport:
    plan: SoakPlan
    seconds: float
    tally: Tally
    events: list[tuple[float, str, str]]
    moves: int
    samples: list[Sample]
    growth: list[Growth]
    left_running: list[str]  # processes started by the soak still alive after it ended


def run_soak(model_dir: Path, plan: SoakPlan, progress: Callable[[str], None] = lambda line: None) -> SoakReport:
    """Run the soak (see the module doc); every process it started is gone when this returns."""
    config = load_config(model_dir)
    inputs = prompts(config.vocab_size, plan.seed)
    answers = local_answers(model_dir, inputs)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    swarm = LocalSwarm(str(model_dir), threads_per_server=1)
    try:
        report = _soak(swarm, model_dir, plan, inputs, answers, config.num_hidden_layers, progress)
    finally:
        swarm.close()
    _, alive = psutil.wait_procs(started_since(before), timeout=10)
    report.left_running = [f"{p.pid}:{p.name()}" for p in alive if p.is_running()]
    return report


# helpers of torch and of Python's multiprocessing that outlive a soak by design (they end with this process)
SHARED_HELPERS = ("torch_shm_manager", "multiprocessing.resource_tracker")


def started_since(before: set[int]) -> list[psutil.Process]:
    """Live descendants of this process not in `before`, except SHARED_HELPERS and the server forkers (a forker
    started for the soak's servers serves the rest of the process's life, tools/prefork.py)."""
    alive = []
    skip = before | prefork.forker_pids()
    for process in psutil.Process().children(recursive=True):
        try:
            if process.pid in skip or process.status() == psutil.STATUS_ZOMBIE:
                continue
            if not any(name in " ".join(process.cmdline()) for name in SHARED_HELPERS):
                alive.append(process)
        except psutil.Error:
            continue
    return alive


def _soak(swarm: LocalSwarm, model_dir: Path, plan: SoakPlan, inputs: list[torch.Tensor], answers: list[list[int]],
          num_blocks: int, progress: Callable[[str], None]) -> SoakReport:  # fmt: skip
    churn, tally, stop = Churn(swarm, num_blocks, plan), Tally(), threading.Event()
    for _ in range(plan.min_servers + 1):
        churn.join()
    models = [connect(swarm, model_dir) for _ in range(plan.clients)]
    trainer = connect(swarm, model_dir, tuning_mode="deep_ptune", pre_seq_len=PRE_SEQ_LEN)
    threads = [threading.Thread(target=generate_loop, args=(m, inputs, answers, churn, tally, stop, i), daemon=True)
               for i, m in enumerate(models)]  # fmt: skip
    threads.append(threading.Thread(target=train_loop, args=(trainer, inputs[0], churn, tally, stop), daemon=True))
    samples: list[Sample] = []
    began = time.monotonic()
    try:
        for thread in threads:
            thread.start()
        _drive(churn, plan, began, samples, tally, progress)
    finally:
        stop.set()
        for thread in threads:
            thread.join(CLIENT_OPTIONS["request_timeout_s"] * 2)
        for model in [*models, trainer]:
            model.close()
    seconds = time.monotonic() - began
    warmup_s = min(120.0, 0.2 * seconds)
    return SoakReport(plan, seconds, tally, churn.events, churn.moves(), samples, growth(samples, warmup_s), [])


def _drive(
    churn: Churn, plan: SoakPlan, began: float, samples: list[Sample], tally: Tally, progress: Callable[[str], None]
) -> None:
    """Sample the servers every sample_interval_s and run an event every event_interval_s until the time is up."""
    next_event, index, end = began + plan.event_interval_s, 0, began + plan.minutes * 60
    while (now := time.monotonic()) < end:
        samples.extend(sample(churn.swarm, now - began))
        if now >= next_event:
            churn.step(index, now - began)
            index, next_event = index + 1, now + plan.event_interval_s
            progress(status(churn, tally))
        time.sleep(max(0.0, min(plan.sample_interval_s, end - time.monotonic())))


def status(churn: Churn, tally: Tally) -> str:
    t, event, server = churn.events[-1]
    with tally.lock:
        counts = f"tokens {tally.tokens}  wrong {tally.wrong_tokens}  lost {len(tally.lost)}"
        counts += f"  uncovered {tally.uncovered}  train steps {tally.train_steps}"
    return f"{t:7.0f} s  {event:5s} {server:4s} live {len(churn.live())}  {counts}"


def connect(swarm: LocalSwarm, model_dir: Path, **options: Any) -> Any:
    return AutoDistributedModelForCausalLM.from_pretrained(
        str(model_dir), initial_peers=swarm.initial_peers, **CLIENT_OPTIONS, **options
    )
