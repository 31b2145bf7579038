"""What this client learned about servers by itself: bans after failures and the measured cost of calls.

Routing must not trust what a server says about its speed (its announced throughput, the compute time it reports in
replies): a server could claim anything to attract routes. The costs here come only from the client's own clock:
the total time of each call, compute included, fitted to `time = fixed + work * per_work` where work is blocks x
tokens of the call. No sockets here: the manager feeds it, routing reads it, unit tests drive it directly.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from swarmlm.swarm.routing import DEFAULT_LATENCY_S

logger = logging.getLogger(__name__)

# weight of the newest call in the exponentially weighted moments of a server's call times
EMA_WEIGHT = 0.3
# the per-work slope is fitted only once calls of clearly different sizes were seen: work's standard deviation must
# exceed this fraction of its mean, otherwise the slope is noise and the (bounded) announced prior is used instead
MIN_WORK_SPREAD = 0.1


@dataclass
class CallStats:
    """Exponentially weighted moments of (work, seconds) over one server's calls."""

    work: float  # mean of blocks x tokens per call
    seconds: float  # mean total call time
    work_sq: float  # mean of work^2
    work_seconds: float  # mean of work x seconds
    calls: int = 1

    @classmethod
    def first(cls, work: float, seconds: float) -> CallStats:
        return cls(work, seconds, work * work, work * seconds)

    def add(self, work: float, seconds: float) -> None:
        w = EMA_WEIGHT
        self.work += w * (work - self.work)
        self.seconds += w * (seconds - self.seconds)
        self.work_sq += w * (work * work - self.work_sq)
        self.work_seconds += w * (work * seconds - self.work_seconds)
        self.calls += 1

    def fit(self, prior_per_work_s: float) -> tuple[float, float]:
        """(fixed seconds per call, seconds per unit of work); the slope falls back to the prior when unmeasurable.

        Whatever the slope, the fixed part is chosen so that the model reproduces the mean measured call time at the
        mean measured work: the cost of calls like the ones measured is what was measured.
        """
        variance = self.work_sq - self.work * self.work
        per_work = prior_per_work_s
        if variance > (MIN_WORK_SPREAD * self.work) ** 2:
            slope = (self.work_seconds - self.work * self.seconds) / variance
            if math.isfinite(slope) and slope > 0:
                per_work = slope
        fixed = max(0.0, self.seconds - per_work * self.work)
        return fixed, per_work


def ban_seconds(failures: int, base_s: float, max_s: float) -> float:
    """How long a server is avoided after its `failures`-th failure in a row: base_s, doubled per further failure,
    at most max_s."""
    return min(base_s * 2 ** (failures - 1), max_s)


def busy_cool_down_s(retry_after_s: float | None, base_s: float, most_s: float) -> float:
    """How long a server that answered busy is avoided: the wait it suggested, at least base_s (a server's hint
    cannot make clients hammer it) and at most most_s (nor keep them away for long: the hint is only a claim)."""
    hint = base_s if retry_after_s is None or not math.isfinite(retry_after_s) else retry_after_s
    return min(max(hint, base_s), max(base_s, most_s))


class Health:
    """Bans (exponential back-off per failing server) and call statistics per server."""

    def __init__(self, ban_base_s: float, ban_max_s: float):
        self.ban_base_s, self.ban_max_s = ban_base_s, ban_max_s
        self._bans: dict[str, tuple[float, int]] = {}  # peer -> (banned until, consecutive failures)
        self._stats: dict[str, CallStats] = {}
        self._cool_downs: dict[str, float] = {}  # peer -> avoided until (busy: not a failure, never escalates)
        self._distrusted: set[str] = set()  # caught returning wrong results: never used again by this client
        self._pings: dict[str, float] = {}  # peer -> last timed rpc_info round trip, for servers never called
        # servers that could not be connected to or did not answer a ping, since they last answered: their records
        # may be anyone's claims, so routes are not sent to try them (exploration skips them)
        self._unanswered: set[str] = set()

    def ban(self, peer_id: str) -> float:
        """Ban a failed server; each further failure doubles the ban (up to ban_max_s). Returns its length in s."""
        failures = self._bans.get(peer_id, (0.0, 0))[1] + 1
        duration = ban_seconds(failures, self.ban_base_s, self.ban_max_s)
        self._bans[peer_id] = (time.monotonic() + duration, failures)
        return duration

    def unreachable(self, peer_id: str) -> float:
        """A server did not answer a dial or a ping: banned like a failure, and not explored until it answers."""
        self._unanswered.add(peer_id)
        return self.ban(peer_id)

    def answered(self, peer_id: str) -> bool:
        """Whether the server answered since it last failed to (every server counts as answering until it fails)."""
        return peer_id not in self._unanswered

    def distrust(self, peer_id: str) -> None:
        """Never route through this server again (it returned a wrong result); a success does not lift this."""
        self._distrusted.add(peer_id)

    def distrusted(self, peer_id: str) -> bool:
        return peer_id in self._distrusted

    def cool_down(self, peer_id: str, seconds: float) -> None:
        """Avoid a busy server for `seconds`, without counting a failure against it."""
        self._cool_downs[peer_id] = time.monotonic() + seconds

    def banned(self) -> set[str]:
        """Servers routes must avoid now: banned after failures, or cooling down after a busy reply."""
        return self.avoided() | self.cooling()

    def avoided(self) -> set[str]:
        """Servers banned after failures (or for good: distrusted), not counting busy cool-downs."""
        now = time.monotonic()
        return {peer for peer, (until, _) in self._bans.items() if until > now} | self._distrusted

    def cooling(self) -> set[str]:
        """Servers cooling down after a busy reply."""
        now = time.monotonic()
        return {peer for peer, until in self._cool_downs.items() if until > now}

    def cooling_left_s(self) -> float:
        """Seconds until the first busy server's cool-down ends (0: none cools down)."""
        now = time.monotonic()
        return min((until - now for until in self._cool_downs.values() if until > now), default=0.0)

    def record_success(self, peer_id: str, seconds: float, work: float) -> None:
        """A call of `work` block-tokens to `peer_id` took `seconds` in total, as measured by this client."""
        self._bans.pop(peer_id, None)
        self._cool_downs.pop(peer_id, None)
        self._unanswered.discard(peer_id)
        self.observe(peer_id, seconds, work)

    def observe(self, peer_id: str, seconds: float, work: float) -> None:
        """A call of `work` block-tokens to `peer_id` was answered in `seconds` (work 0: refused as busy, which
        still tells how near the server is)."""
        if not (math.isfinite(seconds) and math.isfinite(work)) or seconds < 0 or work < 0:
            return
        stats = self._stats.get(peer_id)
        if stats is None:
            self._stats[peer_id] = CallStats.first(work, seconds)
        else:
            stats.add(work, seconds)

    def measured(self, peer_id: str, prior_throughput: float) -> tuple[float, float] | None:
        """(latency_s, throughput) for routing from this client's measurements; None if never measured. A server
        only pinged has its round trip (at least DEFAULT_LATENCY_S) as latency and prior_throughput as throughput.

        prior_throughput (the bounded announced figure, block-tokens per second) is used only for the part the
        measurements cannot tell: how the call time grows with work when all calls were of the same size.
        """
        stats = self._stats.get(peer_id)
        if stats is None:
            ping = self._pings.get(peer_id)
            # a ping leaves out (de)serialization and compute: a server only pinged counts as at least as far as an
            # unmeasured one, or it would look cheaper than the measured servers in use and pull routes off them;
            # the ping tells far servers apart (and jitter among near ones does not break their tie)
            return None if ping is None else (max(ping, DEFAULT_LATENCY_S), prior_throughput)
        prior = 1.0 / prior_throughput if math.isfinite(prior_throughput) and prior_throughput > 0 else 0.0
        fixed, per_work = stats.fit(prior)
        return fixed, (1.0 / per_work if per_work > 0 else prior_throughput)

    def failed(self, peer_id: str) -> bool:
        """Whether the server's last call failed (it was banned and has not succeeded since)."""
        return peer_id in self._bans

    def record_ping(self, peer_id: str, seconds: float) -> None:
        """A round trip without compute (a timed rpc_info) took `seconds`: the latency of a server not yet called."""
        if math.isfinite(seconds) and seconds >= 0:
            self._pings[peer_id] = seconds
            self._unanswered.discard(peer_id)

    def record_unanswered_ping(self, peer_id: str, timeout_s: float) -> float:
        """A ping (or the dial before it) failed within timeout_s: the server counts as that far once its ban is
        over, so it is not pinged before every route. Returns the ban's length."""
        self._pings[peer_id] = timeout_s
        return self.unreachable(peer_id)

    def has_measured(self, peer_id: str) -> bool:
        """Whether this client timed calls of the server (pings do not count)."""
        return peer_id in self._stats

    def knows_latency(self, peer_id: str) -> bool:
        """Whether calls or a ping of the server were timed."""
        return peer_id in self._stats or peer_id in self._pings
