"""What a server's process hands back to the system after a burst of requests: the garbage cycles that cut streams
leave, then the allocator's free pages (glibc keeps them otherwise).

Why collecting matters: a stream the server cuts (a peer over its share, one that vanished) ends in cancelled tasks,
and asyncio keeps a cancelled task's error, whose traceback holds the frames that held the request's parts (about a
megabyte each) and the timeouts that hold the task: a cycle. Only the cyclic collector frees it, and its full
collections, rare by design, walk every object of the process (~400k after importing torch and transformers: a
quarter of a second here). Objects made before serving are frozen out of collections, so collecting what serving
made costs milliseconds and can follow every burst.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


# mallopt's numbers for M_MMAP_THRESHOLD and M_ARENA_MAX (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


def _mallopt(param: int, value: int) -> bool:
    """glibc's mallopt(param, value); False where it is not there or refuses."""
    libc = _libc()
    mallopt = None if libc is None else getattr(libc, "mallopt", None)
    return mallopt is not None and mallopt(param, value) == 1


def map_big_allocations(threshold_bytes: int) -> bool:
    """Give every allocation of threshold_bytes or more a mapping of its own, unmapped when it is freed (glibc; False
    elsewhere). glibc's default threshold rises to the largest block freed so far, after which requests' tensors and
    frames of a few MB come from its arenas, which keep what they held."""
    return _mallopt(M_MMAP_THRESHOLD, threshold_bytes)


def share_one_arena() -> bool:
    """Every thread allocates from one glibc arena (False where mallopt is not glibc's). By default each thread that
    meets contention gets an arena of its own, and what one thread frees only that thread's allocations reuse: the
    event loop reads requests into one arena, the compute thread builds activations in another, and a burst leaves
    both holding their peak. A burst of big forwards peaked 370-454 MB above the server's size with glibc's default
    and 235-315 MB with one arena (tests/integration/test_hostile_peers.py); the threads that allocate large blocks
    are the event loop and the one compute thread, so the shared lock costs little. Call it before the server starts
    its threads: arenas made before keep serving their threads."""
    return _mallopt(M_ARENA_MAX, 1)


def freeze_startup_objects() -> None:
    """Keep the objects made so far (modules, weights' wrappers, the model) out of every later collection: they live
    as long as the server, and walking them made each full collection block the event loop ~0.25 s."""
    gc.collect()
    gc.freeze()


def collect_garbage() -> int:
    """Free the unreachable cycles (the objects found); on the event loop's thread, where their finalizers may run."""
    return gc.collect()


def malloc_trim() -> None:
    """glibc's malloc_trim(0): free memory at the top of every arena, and whole free pages inside them, goes back to
    the system (a no-op elsewhere). Blocking for milliseconds: run it off the event loop."""
    libc = _libc()
    trim = None if libc is None else getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


# once this much was buffered, memory is returned when the buffers empty (smaller bursts leave little to return)
RETURN_AFTER_BYTES = 16 << 20
# under sustained load the buffers never empty: after this many bytes were released, memory is returned all the same
# (a burst of 8 MB forwards from a dozen peer ids left a server twice what its ledger counted)
RETURN_EVERY_BYTES = 64 << 20
# returns are at least this far apart; one asked for sooner is put off, not dropped, so the last of a burst happens
RETURN_INTERVAL_S = 0.5
# a return waits at least this long after it is asked for: the stream whose release asked for it is still unwinding
# (its cancelled tasks become garbage only once its handler has returned)
RETURN_DELAY_S = 0.05
# the last return of a burst is followed by one more this much later: what the last requests held is freed after the
# ledger released their bytes (their streams end once the peer has read the reply, their handlers after)
SETTLE_S = 2.0


class MemoryReturn:
    """Hands memory back after buffers of requests are released: garbage cycles collected (on the event loop), then
    the allocator trimmed (off it). Lives on the server's event loop; `collect` and `trim` are what it runs."""

    def __init__(self, collect: Callable[[], int] = collect_garbage, trim: Callable[[], None] = malloc_trim):
        self._collect, self._trim = collect, trim
        self._peak_bytes = 0  # most bytes buffered since memory was last returned
        self._released_bytes = 0  # bytes released since then
        self._returned_at = -RETURN_INTERVAL_S  # loop time of the last return
        self._task: asyncio.Task | None = None
        self._waiting = False  # the task waits for its time: what is released meanwhile is returned by it
        self._again = False  # asked for while the task was returning: once more afterwards
        self._settling: asyncio.TimerHandle | None = None  # the return that follows the last one of a burst
        self._asked = False  # a return was asked for since the last one that settles
        self.returns = 0  # returns done (stats, tests)

    def buffered(self, total_bytes: int) -> None:
        """All peers now have total_bytes buffered."""
        self._peak_bytes = max(self._peak_bytes, total_bytes)

    def released(self, size: int, total_bytes: int) -> None:
        """size bytes were released, total_bytes stay buffered: return memory after a burst, or every so often under
        load."""
        self._released_bytes += size
        emptied = total_bytes == 0 and self._peak_bytes >= RETURN_AFTER_BYTES
        if emptied or self._released_bytes >= RETURN_EVERY_BYTES:
            self._ask()

    def computed(self) -> None:
        """A computation that held memory of its own (autograd graphs, many times its request's size) has ended:
        return memory, as after a burst (its end need not coincide with the buffers emptying)."""
        self._ask()

    def _ask(self) -> None:
        self._asked = True
        if self._settling is not None:
            self._settling.cancel()  # this return will be followed by its own
            self._settling = None
        if self._waiting:
            return
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._waiting = True
        self._task = asyncio.get_running_loop().create_task(self._return())

    async def _return(self) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(RETURN_DELAY_S, self._returned_at + RETURN_INTERVAL_S - loop.time()))
        self._waiting = False
        self._peak_bytes = self._released_bytes = 0
        self._returned_at = loop.time()
        found = self._collect()
        await asyncio.to_thread(self._trim)
        self.returns += 1
        logger.debug("memory returned after a burst of requests (%d garbage objects freed)", found)
        if self._again:
            self._again = False
            self._task = None
            self._ask()
        elif self._asked:
            self._asked = False
            self._settling = loop.call_later(SETTLE_S, self._settle)

    def _settle(self) -> None:
        self._settling = None
        if not self._waiting and (self._task is None or self._task.done()):
            self._waiting = True
            self._task = asyncio.get_running_loop().create_task(self._return())
