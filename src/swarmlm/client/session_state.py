"""Inference sessions as data: the route, the steps each span's cache holds, the position, rollbacks and replays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, Protocol, TypeVar

import torch

from swarmlm.protocol.bundle import SpanTensors
from swarmlm.protocol.lora import LoraWeights
from swarmlm.swarm.routing import RouteSpan


def cut_step(step: SpanTensors, begin: int, keep: int) -> SpanTensors:
    """The first `keep` tokens of a step that started at token `begin` (keep may be 0: then only its hypo_ids
    remain, since the cache rows it reordered are still reordered after the cut)."""
    if keep == 0:
        return SpanTensors(step.hidden[:, :0], hypo_ids=step.hypo_ids)
    mask, positions = step.attention_mask, step.position_ids
    return replace(
        step,
        hidden=step.hidden[:, :keep],
        attention_mask=None if mask is None else mask[:, : begin + keep],  # (batch, past + new)
        position_ids=None if positions is None else positions[:, :keep],
    )


def cut_history(history: list[SpanTensors], tokens: int) -> list[SpanTensors]:
    """The steps that rebuild a cache cut back to `tokens` tokens: whole steps before the cut, the cut step's head,
    and the reorders (hypo_ids) of the steps after it."""
    kept, begin = [], 0
    for step in history:
        seq = step.hidden.shape[1]
        if begin + seq <= tokens:
            kept.append(step)
        elif begin < tokens or (step.hypo_ids is not None and tokens > 0):
            kept.append(cut_step(step, begin, max(tokens - begin, 0)))
        begin += seq
    return kept


def merge_history(history: list[SpanTensors], max_tokens: int) -> list[SpanTensors]:
    """The same history in fewer steps, for a replay: consecutive steps are joined into one (hidden states and
    positions concatenated, the later step's mask covering both) unless the later one reorders the cache (hypo_ids)
    or either is empty, they differ in what they carry, or the joined step would exceed max_tokens tokens."""
    merged: list[SpanTensors] = []
    for step in history:
        last = merged[-1] if merged else None
        if last is None or not _joinable(last, step, max_tokens):
            merged.append(step)
            continue
        positions = None
        if last.position_ids is not None and step.position_ids is not None:
            positions = torch.cat([last.position_ids, step.position_ids], dim=1)
        hidden = torch.cat([last.hidden, step.hidden], dim=1)
        merged[-1] = replace(last, hidden=hidden, attention_mask=step.attention_mask, position_ids=positions)
    return merged


def _joinable(first: SpanTensors, then: SpanTensors, max_tokens: int) -> bool:
    batch, seq = first.hidden.shape[0], first.hidden.shape[1] + then.hidden.shape[1]
    return (
        then.hypo_ids is None and first.hidden.shape[1] > 0 and then.hidden.shape[1] > 0 and batch * seq <= max_tokens
        and first.prompts is then.prompts
        and (first.attention_mask is None) == (then.attention_mask is None)
        and (first.position_ids is None) == (then.position_ids is None)
    )  # fmt: skip


def sub_step(step: SpanTensors, begin: int, end: int, past: int) -> SpanTensors:
    """Tokens [begin, end) of a step that starts after `past` tokens (hypo_ids go with the first sub-step)."""
    mask, positions = step.attention_mask, step.position_ids
    return replace(
        step,
        hidden=step.hidden[:, begin:end],
        attention_mask=None if mask is None else mask[:, : past + end],  # (batch, past + tokens up to end)
        position_ids=None if positions is None else positions[:, begin:end],
        hypo_ids=step.hypo_ids if begin == 0 else None,
    )


def split_step(step: SpanTensors, max_tokens: int, past: int) -> list[SpanTensors]:
    """A step as consecutive sub-steps of at most max_tokens tokens over all rows (one token a row at least)."""
    batch, seq = step.hidden.shape[:2]
    rows = max(1, max_tokens // max(batch, 1))
    if seq <= rows:
        return [step]
    return [sub_step(step, begin, min(seq, begin + rows), past) for begin in range(0, seq, rows)]


@dataclass
class SpanState:
    """What one server's cache holds for a session: its blocks, the steps it committed (to rebuild it elsewhere),
    and what it holds beyond them after a failed or rolled-back step."""

    start: int  # first block
    end: int  # block after the last
    history: list[SpanTensors] = field(default_factory=list)  # committed steps as the span got them (whole prompts)
    tokens: int = 0  # tokens the server's cache holds (more than the session's position after a failed step)
    pending: SpanTensors | None = None  # a step this server ran that the session has not committed
    broken: bool = False  # its link failed or was closed: the server's cache is lost to us

    def start_from(self, position: int) -> int | None:
        """Where the server must first cut its cache back to for a step at `position` (None: it holds exactly that)."""
        return None if self.tokens == position else position

    def ran(self, step: SpanTensors, position: int) -> None:
        """The server ran `step` on top of `position` tokens: it holds the step, the session has not committed it."""
        self.pending, self.tokens = step, position + step.hidden.shape[1]

    def replayed(self, step: SpanTensors) -> None:
        """The server ran `step` of a replay on top of what it holds: the step is committed history at once."""
        self.history.append(step)
        self.tokens += step.hidden.shape[1]

    def behind(self, position: int, lost: bool) -> bool:
        """Whether the server must be cut back or rebuilt before it runs a step at `position`."""
        return self.tokens != position or self.pending is not None or lost

    def must_rebuild(self, lost: bool) -> bool:
        """After a step failed: whether the span must be rebuilt elsewhere (it ran a step that reordered its cache
        rows, which its server cannot undo, or its cache is lost); otherwise its next step cuts it back."""
        return (self.pending is not None and self.pending.hypo_ids is not None) or lost

    def settle_failed_step(self) -> None:
        """After a step failed: forget a pending step that the server can cut back by itself (one that did not
        reorder its cache rows)."""
        if self.pending is not None and self.pending.hypo_ids is None:
            self.pending = None

    def commit(self, step_counts: bool) -> None:
        """The session committed the step this span holds pending (kept in the history unless it counts for nothing:
        an empty step that only cut the caches)."""
        if step_counts and self.pending is not None:
            self.history.append(self.pending)
        self.pending = None


class Hop(Protocol):
    """One span of a session's route as the state reads it: the server and blocks, what its cache holds, and whether
    that cache is lost to us (the session's links to servers are hops; unit tests use plain data)."""

    @property
    def span(self) -> RouteSpan: ...

    @property
    def state(self) -> SpanState: ...

    @property
    def lost(self) -> bool: ...


H = TypeVar("H", bound=Hop)


@dataclass
class SessionState(Generic[H]):
    """A session's position over blocks [start, end), its route, and the limits every step is checked against."""

    start: int  # first block
    end: int  # block after the last
    max_length: int  # most tokens the session may hold
    position: int = 0  # tokens every block has processed
    batch_size: int | None = None  # rows, known once the route is open
    push: bool = True  # steps may go from server to server (off for the rest of the session after a push fails)
    lora: LoraWeights | None = None  # weights every server applies (sent once to each, again to replacements)
    # the hops holding the session's caches, in block order (empty until the first step opens them); only splice()
    # changes it, so that every failover, replacement and close reads as one edit of the route
    route: list[H] = field(default_factory=list)

    def splice(self, index: int, count: int, hops: Sequence[H]) -> list[H]:
        """Put `hops` in place of route[index : index + count]; returns the hops taken out (the caller closes them)."""
        if not 0 <= index <= index + count <= len(self.route):
            raise IndexError(f"cannot replace hops {index}:{index + count} of a route of {len(self.route)}")
        removed = self.route[index : index + count]
        self.route[index : index + count] = hops
        return removed

    def spans(self) -> list[SpanState]:
        """What each hop's cache holds, in block order."""
        return [hop.state for hop in self.route]

    def check_step(self, step: SpanTensors) -> None:
        """Refuse a step that the session cannot hold (ValueError)."""
        batch, seq = step.hidden.shape[:2]
        if self.position + seq > self.max_length:
            raise ValueError(f"{self.position + seq} tokens exceed the session's max_length {self.max_length}")
        if self.batch_size is not None and batch != self.batch_size:
            raise ValueError(f"step has batch {batch}; the session was opened for batch {self.batch_size}")

    def is_noop(self, step: SpanTensors) -> bool:
        """Whether a step has nothing to compute and nothing to cut (then it makes no call)."""
        behind = any(hop.state.behind(self.position, hop.lost) for hop in self.route)
        return step.hidden.shape[1] == 0 and step.hypo_ids is None and not behind

    def rollback(self, tokens: int) -> None:
        """Roll back to `tokens` tokens: the spans' histories are cut now, their servers' caches at the next step."""
        if not 0 <= tokens <= self.position:
            raise ValueError(f"position must lie in [0, {self.position}], got {tokens}")
        for span in self.spans():
            span.history = cut_history(span.history, tokens)
        self.position = tokens

    def covers(self) -> bool:
        """Whether the route's spans chain block after block from the session's first block to its last."""
        spans = self.spans()
        return (
            bool(spans)
            and spans[0].start == self.start
            and spans[-1].end == self.end
            and all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False))
        )

    def commit(self, step: SpanTensors) -> None:
        """Every span ran `step` (each as it received it): it joins their histories and the position advances."""
        spans = self.spans()
        for span in spans:
            if span.pending is None:  # every path of a step leaves each span holding the step it ran
                raise RuntimeError(f"inference span {span.start}:{span.end} ran no step")
        counts = step.hidden.shape[1] > 0 or step.hypo_ids is not None  # an empty step that only cut leaves no trace
        for span in spans:
            span.commit(counts)
        self.position += step.hidden.shape[1]


def pushable(step: SpanTensors, state: SessionState[H]) -> bool:
    """Whether a step can be pushed from server to server: pushing is on, and a plain step (no reorder, prompts or
    LoRA weights) goes over more than one span that cover the session's blocks in order, none of them lost or
    holding an uncommitted step."""
    return (
        state.push
        and len(state.route) > 1
        and step.hidden.shape[1] > 0
        and step.hypo_ids is None
        and step.prompts is None
        and state.lora is None
        and not any(hop.lost or hop.state.pending is not None for hop in state.route)
        and state.covers()
    )
