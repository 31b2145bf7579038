"""The server's scheduling decisions, as pure functions of data: the queue, a small state and the time `now`.

`schedule` decides what the compute thread runs next (a batch), or until when it waits for more decode steps of a
cohort; the executor (server.scheduler) only runs what it is told and feeds the outcome back into the state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DynamicCache

from swarmlm.server.joining import JoinableRequest, can_join

if TYPE_CHECKING:
    from swarmlm.server.scheduler import Work


# peers remembered for fair share beyond those with queued work; older ones are forgotten (they rejoin as new)
MAX_REMEMBERED_PEERS = 1024


class Kind(IntEnum):
    """Classes of work, most urgent first: a waiting generation step costs a user latency on every token.

    INFERENCE is a session's short step (a decode step, a few speculative tokens, a prompt of at most a quantum):
    it runs whole, before long work. The rest is long work (a session's long prompt or replayed history, a forward,
    a backward): it runs in quanta, taking turns by host and peer whatever its kind, and while short steps wait it
    still gets LONG_TURNS quanta per batch of them, so neither kind starves the other."""

    INFERENCE = 0
    PROMPT = 1
    FORWARD = 2
    BACKWARD = 3


# long work: runs in quanta and shares the compute thread with the short steps (Kind)
LONG_KINDS = frozenset({Kind.PROMPT, Kind.FORWARD, Kind.BACKWARD})
# while both wait, long work runs this many quanta per batch of short steps: a short step waits for at most that
# many quanta, and a long request under a flood of short steps takes at most about (1 + 1/LONG_TURNS) its time
# (a quantum and a decode batch cost about the same on a CPU)
LONG_TURNS = 2


@dataclass(frozen=True, eq=False)
class DecodeStep:
    """A one-token step of a session that may share one forward with other sessions' steps; or the prompt of a fresh
    session (several tokens, one row), which may share one forward with other fresh sessions' prompts."""

    start: int  # blocks [start, end): only steps over the same blocks run together
    end: int
    hidden: torch.Tensor  # (rows, 1, hidden), as received
    cache: DynamicCache  # the session's own cache, which the step extends by one token
    adapter: str | None = None  # the session's LoRA adapter: only steps with the same one share a forward
    mask: torch.Tensor | None = None  # (rows, history + 1): the session's padding mask (None: no padding)
    positions: torch.Tensor | None = None  # (rows, 1): the rows' position ids (None: the history's length)
    budget: int = 0  # of a prompt: the most tokens of all prompts in the forward it joins (the server's chunk)

    @property
    def rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def tokens(self) -> int:
        return self.hidden.shape[1]

    @property
    def prompt(self) -> bool:
        """A fresh session's prompt (several tokens) rather than a one-token decode step."""
        return self.hidden.shape[1] > 1

    @property
    def key(self) -> tuple[int, int, str | None, bool]:
        """Its blocks, adapter and kind (prompt or decode step): only steps with the same key run as one forward."""
        return self.start, self.end, self.adapter, self.prompt


@dataclass(eq=False)
class Task:
    """One request waiting for the compute thread, as the decisions see it (what runs it lies apart, in `work`)."""

    kind: Kind
    peer: str
    seq: int  # arrival order
    decode: DecodeStep | None = None  # set when it may instead join a batched decode step
    join: JoinableRequest | None = None  # set when a forward/backward may run joined with others of its kind
    arrived: float = 0.0  # the scheduler's clock when it was queued
    # of a prompt left over when prompts waiting together were split into groups: the size of each group (the rest
    # of the wave is not split again)
    group: int = 0
    # a long request that ran a quantum already (it runs as a generator, see server.pieces): never joined again
    started: bool = False
    work: Work | None = field(default=None, repr=False)  # what the executor runs; no decision reads it
    host: str = ""  # the peer's host (server.fairness.host_of): turns go round hosts first, then their peers
    # a computation whose memory grows as it runs (autograd graphs: a backward, a forward that keeps its graph):
    # only one such is started at a time, the others wait unstarted, holding only their requests (see schedule)
    exclusive: bool = False


@dataclass(frozen=True)
class BatchLimits:
    max_sessions: int = 32  # sessions in one batched decode step
    max_rows: int = 64  # batch rows (sum of the sessions' batch sizes) in one batched decode step
    max_join_tokens: int = 2048  # batch x sequence tokens of forward (or backward) requests joined into one
    max_join_requests: int = 16  # requests joined into one forward (or backward)
    # a decode batch missing steps of sessions that stepped recently (over the same blocks) waits at most this long
    # for them: concurrent sessions fall into step and share forwards, which on a CPU cost little more than one
    decode_wait_s: float = 0.1
    active_s: float = 1.0  # a session that sent a decode step this recently is expected to send the next one
    # servers a session's steps pass through, this one included (the model's blocks / this span's): with more than
    # one, the active sessions over a span form that many cohorts, and a decode batch holds (and waits for) one
    # cohort. Each server then computes one cohort while the others are elsewhere in the chain (pipelining), where
    # one cohort of all sessions would leave every server idle until it comes round again. A server that is behind
    # (busy almost all the time: SATURATED_SHARE) batches all the steps it has instead.
    stages: int = 1
    # of those, how many come after this one: fresh sessions' prompts waiting together run as 1 + later_stages
    # forwards (the next server starts on the first while this one computes the next); the last server joins them
    later_stages: int = 0
    # tokens (rows x positions) a quantum of a long forward/backward computes while sessions decode here: a decode
    # step that arrives waits for the quantum in progress (a whole block of a 2048-token pass takes ~0.3 s on a CPU
    # core; 256 tokens of it ~40 ms). Without decoding sessions a quantum is a whole block (0)
    quantum_tokens: int = 256


def next_batch(
    queue: Sequence[Task], limits: BatchLimits, last_served: Mapping[str, int],
    host_served: Mapping[str, int] | None = None,
) -> list[Task]:  # fmt: skip
    """The tasks to run next: from the most urgent class present (short steps, else all long work alike), the
    waiting task of the host served least recently, and of its peers the one served least recently (round robin
    between hosts, then peers; the kind, then arrival order break ties), joined, if it is a decode step (or a fresh
    session's prompt), by the other decode steps (prompts) over the same blocks with the same adapter, peers in the
    same order, within `limits` (and, for prompts, their tokens within the head's budget). Empty only for an empty
    queue."""
    if not queue:
        return []
    hosts = host_served or {}
    urgent = min(task.kind for task in queue) not in LONG_KINDS
    order = sorted(
        (t for t in queue if (t.kind not in LONG_KINDS) == urgent),
        key=lambda t: (hosts.get(t.host, -1), last_served.get(t.peer, -1), t.kind, t.seq),
    )
    head = order[0]
    if head.join is not None and not head.started:
        return _joined(head, order[1:], limits)
    if head.decode is None:
        return [head]
    batch, rows, caches = [head], head.decode.rows, {id(head.decode.cache)}
    tokens, budget = head.decode.tokens, min(limits.max_join_tokens, head.decode.budget)
    for task in order[1:]:
        step = task.decode
        if len(batch) >= limits.max_sessions:
            break
        if step is None or not _same_forward(step, head.decode):
            continue
        if rows + step.rows > limits.max_rows or id(step.cache) in caches:
            continue
        if step.prompt and tokens + step.tokens > budget:
            continue
        batch.append(task)
        rows += step.rows
        tokens += step.tokens
        caches.add(id(step.cache))
    return batch


def _same_forward(step: DecodeStep, head: DecodeStep) -> bool:
    """Steps run as one forward only over the same blocks with the same LoRA adapter, and prompts only with
    prompts."""
    return step.key == head.key


def _joined(head: Task, others: Sequence[Task], limits: BatchLimits) -> list[Task]:
    """head with the waiting, not yet started requests of its kind that can join it, in order, within limits."""
    if head.join is None:
        raise ValueError("only a joinable request heads a joined batch")
    batch, tokens = [head], head.join.tokens
    for task in others:
        if len(batch) >= limits.max_join_requests:
            break
        join = task.join
        if join is None or task.started or not can_join(head.join, join):
            continue
        if tokens + join.tokens > limits.max_join_tokens:
            continue
        batch.append(task)
        tokens += join.tokens
    return batch


# a server whose compute thread was busy this share of the last BUSY_WINDOW_S is behind the others of its chain:
# it batches all the decode steps it has, cohorts or not (one forward for many costs little more than for a few)
SATURATED_SHARE = 0.9
BUSY_WINDOW_S = 1.0
# a batch waiting for a due session's step waits this much past the step's expected time (jitter)
_DUE_SLACK_S = 0.005


@dataclass(eq=False)
class Rhythm:
    """When a session's decode steps arrive: the last one, and the smoothed interval between them."""

    key: tuple[int, int, str | None, bool]  # DecodeStep.key of its steps
    last_s: float
    interval_s: float | None = None

    def arrived(self, now: float) -> None:
        gap = now - self.last_s
        self.interval_s = gap if self.interval_s is None else 0.7 * self.interval_s + 0.3 * gap
        self.last_s = now

    @property
    def next_s(self) -> float:
        return self.last_s + (self.interval_s or 0.0)

    def expected(self, now: float, by: float, active_s: float) -> bool:
        """Whether its next step is due by `by` and not overdue yet (it stepped within active_s and keeps a known
        rhythm): a session late beyond a little jitter is not waited for."""
        if self.interval_s is None or now - self.last_s > active_s:
            return False
        return now < self.next_s + _DUE_SLACK_S and self.next_s <= by


@dataclass(eq=False)
class SchedulerState:
    """What the decisions remember between batches: each peer's last turn, each session's rhythm, the busy time."""

    last_served: dict[str, int] = field(default_factory=dict)  # peer -> the turn it was last served in
    host_served: dict[str, int] = field(default_factory=dict)  # host -> the turn it was last served in
    long_turns: int = 0  # quanta of long work run since the last batch of short steps (Kind)
    rhythms: dict[int, Rhythm] = field(default_factory=dict)  # decode steps' timing of each session, by cache id
    busy: deque[tuple[float, float]] = field(default_factory=deque)  # (start, end) of the compute thread's runs
    turns: int = 0

    def track(self, step: DecodeStep, now: float) -> None:
        """Note the arrival of a session's decode step (its rhythm predicts the next one)."""
        rhythm = self.rhythms.get(id(step.cache))
        if rhythm is None:
            if len(self.rhythms) >= MAX_REMEMBERED_PEERS:  # bounded: the stalest go first
                stalest = sorted(self.rhythms, key=lambda c: self.rhythms[c].last_s)
                for cache_id in stalest[: len(stalest) // 2]:
                    del self.rhythms[cache_id]
            self.rhythms[id(step.cache)] = Rhythm(step.key, now)
        else:
            rhythm.arrived(now)

    def forget(self, cache: DynamicCache) -> None:
        """The session owning `cache` ended: no batch waits for its steps any more."""
        self.rhythms.pop(id(cache), None)

    def served(self, peers: Sequence[str], waiting: set[str], hosts: Sequence[str] = (), long: bool = False) -> None:
        """A batch of these peers' requests (from these hosts; `long`: a quantum of long work) runs: one turn; the
        oldest peers and hosts not `waiting` are forgotten past MAX_REMEMBERED_PEERS."""
        self.turns += 1
        self.long_turns = self.long_turns + 1 if long else 0
        for peer in peers:
            self.last_served[peer] = self.turns
        for host in hosts:
            self.host_served[host] = self.turns
        for served in (self.last_served, self.host_served):
            if len(served) <= MAX_REMEMBERED_PEERS:
                continue
            for key in sorted(served, key=served.__getitem__):
                if len(served) <= MAX_REMEMBERED_PEERS // 2:
                    break
                if key not in waiting:
                    del served[key]

    def ran(self, began: float, ended: float) -> None:
        """The compute thread ran a batch from `began` to `ended`; runs older than BUSY_WINDOW_S are dropped."""
        self.busy.append((began, ended))
        while self.busy and self.busy[0][1] <= ended - BUSY_WINDOW_S:
            self.busy.popleft()


def busy_share(state: SchedulerState, now: float) -> float:
    """The share of the BUSY_WINDOW_S before `now` the compute thread spent running batches."""
    since = now - BUSY_WINDOW_S
    return sum(max(0.0, end - max(start, since)) for start, end in state.busy) / BUSY_WINDOW_S


def cohort(
    batch: Sequence[Task], queue: Sequence[Task], state: SchedulerState, limits: BatchLimits, now: float
) -> int:
    """The most sessions a decode batch like `batch` holds and waits for: a cohort of the sessions active over its
    blocks (BatchLimits.stages), unless this server is behind. Prompts waiting together split likewise when servers
    come after this one (BatchLimits.later_stages): the next one starts on the first group while this one computes
    the next, where one forward of all of them would keep it idle until that ended (on a CPU a joined prompt costs
    nearly what it costs alone, so joining them all saves little)."""
    head = batch[0].decode if batch else None
    if head is None or busy_share(state, now) >= SATURATED_SHARE:
        return limits.max_sessions
    if head.prompt:
        if batch[0].group:
            return batch[0].group
        groups = 1 + limits.later_stages
        sessions = sum(1 for task in queue if task.decode is not None and task.decode.key == head.key)
    else:
        groups = limits.stages
        sessions = sum(1 for r in state.rhythms.values() if r.key == head.key and now - r.last_s <= limits.active_s)
    if groups <= 1:
        return limits.max_sessions
    return max(1, min(limits.max_sessions, -(-sessions // groups)))


def wait_until(
    batch: Sequence[Task], size: int, queue: Sequence[Task], state: SchedulerState, limits: BatchLimits, now: float
) -> float | None:
    """Until when a decode batch short of its cohort (`size`) waits for the steps of other sessions over the same
    blocks that are due within the wait (they stepped recently and their next step is expected by then, from their
    own rhythm), or None to run it now: one forward for all costs little more than one for a few, so concurrent
    sessions fall into step and share forwards. A session whose next step is not expected that soon (a slow link,
    a pause) is never waited for."""
    head = batch[0].decode if batch else None
    if head is None or head.prompt or limits.decode_wait_s <= 0 or len(batch) >= size:
        return None
    if any(task.decode is None or task.decode.prompt for task in queue):
        return None  # other work waits too: run what is here
    deadline = min(task.arrived for task in batch) + limits.decode_wait_s
    if now >= deadline:
        return None
    present = {id(task.decode.cache) for task in batch if task.decode is not None}
    others = (r for cache_id, r in state.rhythms.items() if r.key == head.key and cache_id not in present)
    due = sorted(r.next_s for r in others if r.expected(now, deadline, limits.active_s))
    due = due[: size - len(batch)]  # the earliest, up to a full cohort
    if not due:
        return None
    return min(deadline, max(due) + _DUE_SLACK_S)


@dataclass(frozen=True)
class Decision:
    """What the compute thread does next: run `batch`, or (`wait_until` set) wait until then, or until a request
    arrives, and decide again."""

    batch: list[Task] = field(default_factory=list)
    wait_until: float | None = None
    # prompts of the same wave left for later: each gets `group` (the size its wave was split into) before `batch`
    # runs, so the rest of the wave runs in groups of the same size
    regroup: list[Task] = field(default_factory=list)
    group: int = 0
    quantum: int = 0  # of a long task: the tokens its next quantum computes (0: a whole block)


def quantum(queue: Sequence[Task], state: SchedulerState, limits: BatchLimits, now: float) -> int:
    """The tokens the next quantum of a long forward/backward computes: BatchLimits.quantum_tokens while sessions
    decode here (an inference step waits, or a session stepped within active_s), since their next step waits for
    the quantum in progress; otherwise 0, a whole block (fewer, larger quanta)."""
    if limits.quantum_tokens <= 0:
        return 0
    waiting = any(task.kind == Kind.INFERENCE for task in queue)
    if waiting or any(now - rhythm.last_s <= limits.active_s for rhythm in state.rhythms.values()):
        return limits.quantum_tokens
    return 0


def schedule(queue: Sequence[Task], state: SchedulerState, limits: BatchLimits, now: float) -> Decision:
    """The next batch (next_batch, cut to a cohort for decode steps and prompts), or a wait for more steps of a
    cohort, and the size of a long task's next quantum. While short steps and long work both wait, they take turns
    (LONG_TURNS quanta of long work per short batch): a flood of either leaves the other a good share of the compute
    thread, and a short step waits for at most LONG_TURNS quanta. Reads the queue and the state, changes neither."""
    if any(task.exclusive and task.started for task in queue):
        # one computation that builds autograd graphs at a time: interleaved, each would hold its graphs (many times
        # its request's size) while the others run, so a burst of them from many peer ids would hold them all
        queue = [task for task in queue if task.started or not task.exclusive]
    everything, long = queue, [task for task in queue if task.kind in LONG_KINDS]
    if long and state.long_turns < LONG_TURNS and len(long) < len(queue):
        queue = long  # long work's turn: decided as if only it waited (the quantum's size sees everything)
    batch = next_batch(queue, limits, state.last_served, state.host_served)
    if not batch:
        return Decision()
    head = batch[0].decode
    if head is None:
        return Decision(batch, quantum=quantum(everything, state, limits, now))
    size = cohort(batch, queue, state, limits, now)
    regroup = batch[size:] if head.prompt else []
    batch = batch[:size]  # the rest runs next, as the next cohort
    until = wait_until(batch, size, queue, state, limits, now)
    if until is not None:
        return Decision(wait_until=until)
    # a long session step (a prompt or replay beyond a quantum) that runs alone runs in quanta like other long work
    pieces = quantum(everything, state, limits, now) if len(batch) == 1 and batch[0].kind in LONG_KINDS else 0
    return Decision(batch, regroup=regroup, group=size if regroup else 0, quantum=pieces)
