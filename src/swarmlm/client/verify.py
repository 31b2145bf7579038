"""Spot checks of servers' results: when a span's result is re-run on independent servers, how close two honest
results are, who is in the minority when they differ, and the learned bounds every reply's norms must stay within.

A server can return well-formed, finite, plausible hidden states that are simply wrong. The client cannot compute
the blocks itself, so it asks others: with probability `verify_probability` per call (always for the first
`verify_first_requests` calls of a server it has not checked yet, more often for servers other clients reported,
and whenever a reply's norms leave what verified replies showed), the same input runs through the same blocks on
servers not involved in the first result. Two results agree when every token's hidden state differs by at most a
relative tolerance set by the servers' dtypes. On disagreement a third, again independent, route settles it: the
side that disagrees with the other two is wrong; its servers are banned by this client for good and (when the wrong
side is one server) reported on the DHT. With no third route the request fails rather than return either result.
No sockets here: the chain runner and inference sessions pass a `rerun` coroutine.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from swarmlm.client import trace
from swarmlm.errors import RemoteCallError

logger = logging.getLogger(__name__)

# largest relative per-token difference between two honest results, by the coarsest dtype involved: honest servers
# differ only by summation order and batching (fp32 ~1e-6 relative over a few blocks; half types ~1e-3 per block)
DTYPE_TOLERANCE = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
# what rounding activations to the client's wire dtype adds to the difference of two honest results of a span: 16-bit
# wires as much as computing in that dtype (a rounding at a hop boundary inside one route and not the other: up to
# 1e-2 on SmolLM2); int8 rows whose values honest results differ in by their last bits round apart by a step of at
# most absmax / 127, under 0.8% of the token's norm each
WIRE_TOLERANCE = {"float32": 0.0, "bfloat16": 5e-2, "float16": 2e-2, "int8": 2e-2}
# wires whose rounding at a hop boundary moves a span's result beyond any useful tolerance (int8 with one scale per
# token: 16-49% per token on SmolLM2, whose hidden states have outlier features): results are compared only when
# each came from one server
HOP_SENSITIVE_WIRES = frozenset({"int8"})
# a reply's per-token RMS may lie this factor beyond the range verified replies of the same last block showed
NORM_SLACK = 8.0
# verified replies needed for a block before its norm bounds are enforced
MIN_NORM_SAMPLES = 3
# check probability for servers that other clients reported for wrong results (a report is a claim: it buys checks,
# not a ban)
REPORTED_PROBABILITY = 0.5
# guards divisions by the norm of an all-zero hidden state
_TINY = 1e-12


class UnverifiedResultError(RemoteCallError):
    """Two routes disagreed on a span's result and no third one could settle which is right."""


@dataclass(frozen=True)
class Opinion:
    """One route's result for a span: the servers that produced it, their dtypes, the output, and the client's wire
    dtype that the span's input, its output and the hidden states between its servers travelled in."""

    peers: tuple[str, ...]
    dtypes: tuple[str, ...]
    output: torch.Tensor
    wire: str = "float32"


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest per-token ||a - b|| / ||b|| over hidden states (batch, seq, hidden); inf for other shapes."""
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    a, b = a.float(), b.float()
    diff = (a - b).norm(dim=-1)
    scale = torch.maximum(a.norm(dim=-1), b.norm(dim=-1)).clamp_min(_TINY)
    return float((diff / scale).max())


def tolerance(dtypes: tuple[str, ...]) -> float:
    """The tolerance of results computed in these dtypes (an unknown dtype gets the coarsest)."""
    coarsest = max(DTYPE_TOLERANCE.values())
    return max((DTYPE_TOLERANCE.get(d, coarsest) for d in dtypes), default=coarsest)


def agree(a: Opinion, b: Opinion) -> bool:
    coarsest = max(WIRE_TOLERANCE.values())
    wire = max(WIRE_TOLERANCE.get(a.wire, coarsest), WIRE_TOLERANCE.get(b.wire, coarsest))
    return relative_difference(a.output, b.output) <= max(tolerance(a.dtypes + b.dtypes), wire)


def comparable(first: Opinion, other: Opinion | None) -> Opinion | None:
    """`other` if it can be compared with `first`, else None (as if no independent route existed): under a
    hop-sensitive wire, only a result computed in as many hops (first is one server's)."""
    if other is not None and other.wire in HOP_SENSITIVE_WIRES and len(other.peers) != len(first.peers):
        return None
    return other


class Verifier:
    """What this client knows about servers' results: who passed checks, who was reported, and norm bounds."""

    def __init__(self, probability: float, first_requests: int, rng: random.Random | None = None):
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"verify_probability must lie in [0, 1], got {probability}")
        self.probability, self.first_requests = probability, first_requests
        self.reported: set[str] = set()  # servers other clients reported (refreshed from the DHT)
        self._passed: dict[str, int] = {}  # peer -> checks it passed
        self._norms: dict[int, tuple[float, float, int]] = {}  # last block -> (min rms, max rms, verified replies)
        self._rng = rng or random.Random()

    def reason_to_check(self, peers: tuple[str, ...], end_block: int, output: torch.Tensor) -> str | None:
        """Why the result of `peers` for blocks ending at end_block should be checked now, or None."""
        if any(self._passed.get(peer, 0) < self.first_requests for peer in peers):
            return "new server"
        if not self.norms_plausible(end_block, output):
            return "norm out of bounds"
        probability = self.probability
        if any(peer in self.reported for peer in peers):
            probability = max(probability, REPORTED_PROBABILITY)
        if probability > 0 and self._rng.random() < probability:
            return "reported" if probability > self.probability else "random"
        return None

    def passed(self, peers: tuple[str, ...], end_block: int, output: torch.Tensor) -> None:
        """The result of `peers` agreed with an independent one: count it and learn its norms."""
        for peer in peers:
            self._passed[peer] = self._passed.get(peer, 0) + 1
        rms = _token_rms(output)
        if rms is None:
            return
        low, high = float(rms.min()), float(rms.max())
        old = self._norms.get(end_block)
        if old is not None:
            low, high = min(low, old[0]), max(high, old[1])
        self._norms[end_block] = (low, high, 1 if old is None else old[2] + 1)

    def norms_plausible(self, end_block: int, output: torch.Tensor) -> bool:
        """Whether every token's RMS lies within NORM_SLACK of what verified replies of this block showed."""
        bounds = self._norms.get(end_block)
        rms = _token_rms(output)
        if bounds is None or bounds[2] < MIN_NORM_SAMPLES or rms is None:
            return True
        low, high, _ = bounds
        return bool(rms.min() >= low / NORM_SLACK and rms.max() <= high * NORM_SLACK)


def _token_rms(output: torch.Tensor) -> torch.Tensor | None:
    if output.ndim != 3 or output.numel() == 0:
        return None
    return output.float().pow(2).mean(dim=-1).sqrt()


# re-runs the checked span's input on servers not in the given set; None when no such route exists
Rerun = Callable[[set[str]], Awaitable[Opinion | None]]
# called with the servers found wrong and why: ban them (and report them)
Convict = Callable[[tuple[str, ...], str], None]


async def settle(
    verifier: Verifier, first: Opinion, rerun: Rerun, convict: Convict, start: int, end: int, reason: str
) -> Opinion:
    """Check `first` against independent routes and return the result to use (raises UnverifiedResultError)."""
    second = comparable(first, await rerun(set(first.peers)))
    if second is None:
        _record(start, end, first, reason, "unchecked")
        return first
    if agree(first, second):
        verifier.passed(first.peers + second.peers, end, first.output)
        _record(start, end, first, reason, "agreed", second.peers)
        return first
    third = comparable(first, await rerun(set(first.peers) | set(second.peers)))
    checkers = second.peers + (() if third is None else third.peers)
    if third is None or (agree(third, first) == agree(third, second)):
        _record(start, end, first, reason, "unsettled", checkers)
        raise UnverifiedResultError(
            f"blocks {start}:{end}: servers {_short(first.peers)} and {_short(second.peers)} returned different "
            f"results (relative difference {relative_difference(first.output, second.output):.2e}) and "
            + ("no third server could settle it" if third is None else "a third disagreed with both")
        )
    right, wrong = (first, second) if agree(third, first) else (second, first)
    difference = relative_difference(wrong.output, right.output)
    convict(wrong.peers, f"wrong result for blocks {start}:{end} (relative difference {difference:.2e})")
    verifier.passed(right.peers + third.peers, end, right.output)
    _record(start, end, first, reason, f"wrong: {_short(wrong.peers)}", checkers)
    return right


def _record(start: int, end: int, first: Opinion, reason: str, outcome: str, checkers: tuple[str, ...] = ()) -> None:
    trace.record_check(trace.CheckTrace(start, end, first.peers, reason, outcome, checkers))
    # "unchecked" is the normal state of a swarm without replicas: not worth a line per request
    level = logging.DEBUG if outcome in ("agreed", "unchecked") else logging.WARNING
    logger.log(level, "Check of blocks %d:%d from %s (%s): %s", start, end, _short(first.peers), reason, outcome)


def _short(peers: tuple[str, ...]) -> str:
    return " ".join(f"...{peer[-6:]}" for peer in peers)
