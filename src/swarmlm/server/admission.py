"""Whether a server takes a new inference session now, and when a refused one should come back: pure decisions over
the server's ledger (session slots, per-peer and per-host shares) and cache budget. The server calls them when a
session opens; the simulator calls the same functions for its simulated servers."""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarmlm.server.peers import LimitError, PeerLedger

# a refused session is told to come back no sooner than this (a full server is not asked again at once) ...
MIN_RETRY_AFTER_S = 1.0
# ... and no later than this (estimates from few sessions can be far off; the client bounds it too)
MAX_RETRY_AFTER_S = 300.0
# weight of the newest session in the moving average of session lengths
LENGTH_EMA_WEIGHT = 0.1
# length assumed before any session ended: a chat of a few turns (the first estimates are refined quickly)
PRIOR_SESSION_S = 60.0


@dataclass
class SessionLengths:
    """A moving average of how long this server's sessions stay open, for the retry hint of a busy answer."""

    mean_s: float = PRIOR_SESSION_S
    ended: int = 0

    def end(self, length_s: float) -> None:
        if math.isfinite(length_s) and length_s >= 0:
            # the plain mean of the sessions ended so far until there are 1 / LENGTH_EMA_WEIGHT of them, then the
            # moving average: the prior goes with the first session instead of weighing on the hints of the next
            # twenty (with 2-3 s sessions a server still hinted 6-10 s after a dozen had ended, and users waiting
            # for its cool-down were refused while its slots kept freeing up)
            weight = max(LENGTH_EMA_WEIGHT, 1 / (self.ended + 1))
            self.mean_s += weight * (length_s - self.mean_s)
            self.ended += 1

    def retry_after_s(self, open_sessions: int) -> float:
        """retry_after_s for the server's open sessions and their average length."""
        return retry_after_s(open_sessions, self.mean_s)


def retry_after_s(open_sessions: int, mean_session_s: float) -> float:
    """When a refused session should come back: if the open sessions end at random over their average length, one of
    them ends after mean / open seconds on average; bounded to [MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S]."""
    wait = mean_session_s / max(1, open_sessions)
    return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, wait))


def admit_now(ledger: PeerLedger, cache_used: int, cache_capacity: int, peer: str, tokens: int) -> LimitError | None:
    """None when the server has a session slot and `tokens` cache block-tokens for `peer` right now (and counts the
    session on the ledger); else the refusal, without waiting or reclaiming (the server tries those next, the
    simulator's servers do not wait). too_large: the session exceeds the whole cache or the peer's share of it."""
    if tokens > cache_capacity:
        return LimitError(
            f"a session of {tokens} block-tokens exceeds this server's cache of {cache_capacity}", "too_large"
        )
    try:
        ledger.open_session(peer)
    except LimitError as e:
        return e
    try:
        ledger.check_cache(peer, tokens, cache_capacity)
    except LimitError as e:
        ledger.close_session(peer)
        return e
    if cache_used + tokens > cache_capacity:
        ledger.close_session(peer)
        return LimitError(
            f"server busy: {cache_used} of {cache_capacity} cache block-tokens in use, {tokens} asked", "busy"
        )
    return None
