"""Log lines about what peers do wrong, rate-limited per peer: a peer's cheap faults must not flood the log.

Anything a peer can cause (a malformed request, a stalled or cut stream, a refused open) is told in one line, never
with a traceback; a peer that keeps at it gets one line per interval, which counts the lines left out since. The
server's handler, sessions and transport share one limiter (PEER_FAULTS), so a peer has one allowance per process.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable

# a peer's faults are logged at most once per this many seconds; the others are counted into its next line
PEER_LOG_INTERVAL_S = 10.0
# peers remembered (the least recently logged are forgotten first): identities are free, memory is not
MAX_PEERS_REMEMBERED = 4096
# lines about all peers together per interval: identities are free, so a limit per peer alone would let a thousand
# ids write a thousand lines per interval; past it, lines are counted and told in one line per interval
MAX_LINES_PER_INTERVAL = 20


class PeerFaults:
    """Rate-limited warnings about peers, at most one per peer per interval_s (clock: seconds, injectable)."""

    def __init__(
        self, interval_s: float = PEER_LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
        capacity: int = MAX_PEERS_REMEMBERED, max_lines: int = MAX_LINES_PER_INTERVAL,
    ):  # fmt: skip
        self.interval_s, self.clock, self.capacity = interval_s, clock, capacity
        self.max_lines = max_lines
        self._peers: OrderedDict[str, tuple[float, int]] = OrderedDict()  # peer -> (last line's time, lines left out)
        self._window = (-math.inf, 0, 0)  # all peers': (start of this interval, lines logged in it, lines left out)

    def warning(self, logger: logging.Logger, peer: str, message: str, *args: object) -> bool:
        """Log `message % args` (one line) to `logger` unless this peer had a line less than interval_s ago; whether
        it did."""
        now = self.clock()
        last, left_out = self._peers.get(peer, (-math.inf, 0))
        if now - last < self.interval_s:
            self._peers[peer] = (last, left_out + 1)
            return False
        if not self._room(logger, now):
            self._peers[peer] = (now, left_out + 1)  # its next line, an interval on, counts this one
            self._peers.move_to_end(peer)
            self._forget_oldest()
            return False
        if left_out:
            message += f" (and {left_out} more from this peer in {now - last:.0f} s)"
        logger.warning(message, *args)
        self._peers[peer] = (now, 0)
        self._peers.move_to_end(peer)
        self._forget_oldest()
        return True

    def _room(self, logger: logging.Logger, now: float) -> bool:
        """Whether all peers' lines of this interval leave room for one more (a new interval tells what the last
        one left out, in one line)."""
        began, lines, left_out = self._window
        if now - began >= self.interval_s:
            if left_out:
                logger.warning("%d more lines about peers' faults were left out in %.0f s (too many peers at once)",
                               left_out, now - began)  # fmt: skip
            began, lines, left_out = now, 0, 0
        if lines >= self.max_lines:
            self._window = (began, lines, left_out + 1)
            return False
        self._window = (began, lines + 1, left_out)
        return True

    def _forget_oldest(self) -> None:
        while len(self._peers) > self.capacity:
            self._peers.popitem(last=False)


PEER_FAULTS = PeerFaults()  # the process's limiter (a log is per process too)
