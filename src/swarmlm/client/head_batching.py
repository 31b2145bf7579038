"""The LM head of several generations at once: threads of one client (the API server's requests, users of one model
object) that need logits at the same time get them from one matrix product.

On a CPU, the head of a decode step is bound by reading its weight (vocabulary x hidden: 113 MB for SmolLM2 in
float32), not by arithmetic; rows of concurrent steps stacked into one product read it once. A thread that finds the
head idle runs it on whatever rows are queued; rows that arrive meanwhile run together next, as continuous batching
does on the servers. The decode steps of concurrent generations come back from the last server in cohorts (it
batches them), but reach their threads a little apart, so a thread that finds fewer rows queued than there are
generations waits briefly for the rest of its cohort: at most GATHER_MAX_S, and only while rows keep arriving (each
within GATHER_GAP_S of the last). A generation alone never waits.

Products of up to 12 rows by a float32 head run in the rows kernel (client/rows_kernel.py) against a copy of the
weight packed for it: it reads the weight once per 8 rows at about the speed memory streams, where MKL takes about
2 and 3 times as long for 2 and 4 rows as for 1. Larger products run in torch. Where the kernel cannot be built
(no C compiler), every product multiplies by a copy MKL has packed once for repeated products (its packed GEMM, as
torch's own compiled CPU linears use): MKL's usual path repacks the weight on every call, which for a few rows
costs about as much as the product itself. `python bench/head_batch.py` compares the three by rows. Either copy is
made at the first product, so it costs the head's size in memory once the client generates (113 MB for SmolLM2).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarmlm.client import rows_kernel
from swarmlm.client.rows_kernel import float32_cpu_matrix

logger = logging.getLogger(__name__)

_Copy = rows_kernel.PackedWeight | torch.Tensor | None  # a packed copy of a head's weight: the kernel's, MKL's, none

# a thread that used the head this recently counts as an active generation (one decode step apart is far less)
ACTIVE_S = 0.5
# a thread gathering its cohort's rows waits at most this long, and stops when none arrived for GATHER_GAP_S
GATHER_MAX_S = 0.006
GATHER_GAP_S = 0.002
# the rows per product MKL packs the weight for (a hint to its packing; products of any size use the copy)
PACK_ROWS_HINT = 4


@dataclass(eq=False)
class _Rows:
    head: Callable[[torch.Tensor], torch.Tensor]
    hidden: torch.Tensor  # (..., hidden)
    result: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


class HeadBatcher:
    """Calls a head ((rows, hidden) -> (rows, vocab)) on the rows of all threads waiting at the same time with the
    same head; each thread gets back its own rows' output, shaped like its input (..., vocab). Gradients do not flow
    through it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # monotonic seconds (a test gives its own to check the timing rules without waiting)
        self._lock = threading.Condition()
        self._queue: list[_Rows] = []
        self._running = False
        self.batches = 0  # products run (for statistics)
        self.rows = 0  # rows they carried
        self._last_call: dict[int, float] = {}  # thread ident -> when it last called (monotonic s)
        # by id(head): the weight a packed copy was made of, its version then, the kernel it was made for (None:
        # MKL's copy), and the copy (None: not packable)
        self._packed: dict[int, tuple[torch.Tensor, int, rows_kernel.RowsKernel | None, _Copy]] = {}

    def __call__(self, head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        mine = _Rows(head, hidden)
        with self._lock:
            self._queue.append(mine)
            self._lock.notify_all()  # a thread gathering its cohort sees the new rows
            active = self._active(self._clock())
            while self._running and not mine.done:
                self._lock.wait()
            if not mine.done and len(self._queue) < active:
                self._gather(mine, active)
            if not mine.done:  # the head is idle: this thread runs it for everything queued
                batch, self._queue, self._running = self._queue, [], True
        if not mine.done:
            self._run(batch)
        if mine.error is not None:
            raise mine.error
        if mine.result is None:
            raise RuntimeError("the LM head batch ended without this caller's rows")
        return mine.result

    def _active(self, now: float) -> int:
        """Generations using the head now: threads that called it within ACTIVE_S, the caller included (called with
        the lock held)."""
        self._last_call[threading.get_ident()] = now
        if len(self._last_call) > 64:  # forget threads long gone
            self._last_call = {t: at for t, at in self._last_call.items() if now - at < ACTIVE_S}
        return sum(1 for at in self._last_call.values() if now - at < ACTIVE_S)

    def _gather(self, mine: _Rows, active: int) -> None:
        """Wait (with the lock held, releasing it meanwhile) for more of the active generations' rows: until all are
        queued, none arrived for GATHER_GAP_S, GATHER_MAX_S passed, or another thread took the head."""
        began = last = self._clock()
        queued = len(self._queue)
        while not mine.done and not self._running and queued < active:
            now = self._clock()
            left = min(last + GATHER_GAP_S, began + GATHER_MAX_S) - now
            if left <= 0:
                return
            self._lock.wait(left)
            if len(self._queue) != queued:
                queued, last = len(self._queue), self._clock()
        while self._running and not mine.done:  # another thread took the head meanwhile (and maybe these rows)
            self._lock.wait()

    def _product(self, head: Callable[[torch.Tensor], torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
        """head(flat) for flat (rows, hidden), by a packed weight where that applies: the rows kernel's for up to
        MAX_ROWS rows where it can be had, else MKL's."""
        if type(head) is not torch.nn.Linear or not float32_cpu_matrix(head.weight) or flat.dtype != torch.float32:
            return head(flat)
        kernel = rows_kernel.kernel()
        if kernel is not None and flat.shape[0] > rows_kernel.MAX_ROWS:
            return head(flat)  # beyond the kernel's rows, torch's usual product (no second copy of the weight)
        if kernel is None and not packable(head.weight):
            return head(flat)
        weight, version = head.weight, _version(head.weight)
        entry = self._packed.get(id(head))
        if entry is None or entry[0] is not weight or entry[1] != version or entry[2] is not kernel:
            # new, replaced, changed in place, or made for the other kind of product
            copy: _Copy = None
            if version >= 0:
                copy = kernel.pack(weight) if kernel is not None else pack_weight(weight)
            entry = self._packed[id(head)] = (weight, version, kernel, copy)
        packed = entry[3]
        if packed is None:
            return head(flat)
        if kernel is not None and isinstance(packed, rows_kernel.PackedWeight):  # made for this kernel (entry[2])
            return kernel.product(flat, packed, head.bias)
        rows = flat.contiguous()
        return torch.ops.mkl._mkl_linear(rows, packed, weight, head.bias, rows.shape[0])

    def _run(self, batch: list[_Rows]) -> None:
        try:
            kinds = {(id(rows.head), rows.hidden.dtype, rows.hidden.device, rows.hidden.shape[-1]) for rows in batch}
            if len(kinds) == 1:
                flat = [rows.hidden.reshape(-1, rows.hidden.shape[-1]) for rows in batch]
                with torch.no_grad():
                    out = self._product(batch[0].head, torch.cat(flat) if len(flat) > 1 else flat[0])
                for rows, part in zip(batch, torch.split(out, [f.shape[0] for f in flat]), strict=True):
                    rows.result = part.reshape(*rows.hidden.shape[:-1], part.shape[-1])
            else:  # mixed heads, dtypes or devices: each alone
                with torch.no_grad():
                    for rows in batch:
                        rows.result = rows.head(rows.hidden)
        except BaseException as e:  # noqa: BLE001 - every waiting thread gets the error of the product it was in
            for rows in batch:
                rows.error = e
        finally:
            with self._lock:
                self.batches += 1
                self.rows += sum(rows.hidden.numel() // max(rows.hidden.shape[-1], 1) for rows in batch)
                for rows in batch:
                    rows.done = True
                self._running = False
                self._lock.notify_all()


def packable(weight: torch.Tensor) -> bool:
    """Whether this torch can make MKL's packed copy of `weight` (a float32 CPU matrix, MKL present)."""
    return float32_cpu_matrix(weight) and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _version(weight: torch.Tensor) -> int:
    """The weight's version counter (bumped by every in-place change); -1 where it has none (an inference tensor)."""
    try:
        return int(weight._version)
    except RuntimeError:
        return -1


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """MKL's packed copy of a Linear weight (out, in), or None when this torch cannot pack it or the packed product
    does not match the usual one (then the head runs as usual)."""
    weight = weight.detach()
    try:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_ROWS_HINT)
        probe = torch.randn(PACK_ROWS_HINT, weight.shape[1], generator=torch.Generator().manual_seed(0))
        got = torch.ops.mkl._mkl_linear(probe, packed, weight, None, PACK_ROWS_HINT)
        torch.testing.assert_close(got, F.linear(probe, weight), rtol=1e-4, atol=1e-4)
    except (RuntimeError, AssertionError) as e:
        # DEBUG: it happens at a generation's first token, in the middle of what a chat prints
        logger.debug("the LM head runs unpacked: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
    logger.debug("packed the LM head for its products (%.0f MB)", weight.numel() * 4 / 1e6)
    return packed


class LoopHeadBatcher:
    """The LM head of generations that run as coroutines on one event loop: rows awaiting logits at about the same
    time go through one product on a worker thread, so the loop keeps serving the other generations' network
    meanwhile.

    `stepping` counts the generations whose step is still out at the servers (their caller keeps it). Queued rows
    wait while some are: until those rows arrive too, for at most GATHER_MAX_S, and only while rows keep coming
    (each within GATHER_GAP_S of the last); with none out, they go at once. Rows that come while a product runs go in
    the next one. Await it on the loop only."""

    def __init__(self, product: Callable[[torch.Tensor], torch.Tensor]):
        self._product = product  # (rows, hidden) -> (rows, vocab), run on the worker thread
        self.stepping = 0
        self._queue: list[tuple[torch.Tensor, asyncio.Future[torch.Tensor]]] = []
        self._first = self._last = 0.0  # when the oldest and the newest queued rows came (the loop's clock, s)
        self._running = False
        self._timer: asyncio.TimerHandle | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.batches = 0  # products run (for statistics)
        self.rows = 0  # rows they carried

    async def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, hidden) -> (rows, vocab)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[torch.Tensor] = loop.create_future()
        now = loop.time()  # the clock its timers (call_later) run by
        if not self._queue:
            self._first = now
        self._queue.append((hidden, future))
        self._last = now
        self._consider()
        return await future

    def close(self) -> None:
        if self.batches:
            logger.debug(
                "LM head on the loop: %d products of %.2f rows on average", self.batches, self.rows / self.batches
            )
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _consider(self) -> None:
        """Start a product now, or look again when the gathering's time is up."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._running or not self._queue:
            return
        wait = 0.0
        if self.stepping > 0:
            wait = min(self._last + GATHER_GAP_S, self._first + GATHER_MAX_S) - asyncio.get_running_loop().time()
        if wait > 0:
            self._timer = asyncio.get_running_loop().call_later(wait, self._consider)
            return
        batch, self._queue, self._running = self._queue, [], True
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="swarmlm-head")
        rows = [hidden for hidden, _ in batch]
        done = asyncio.get_running_loop().run_in_executor(self._executor, self._run, rows)
        done.add_done_callback(lambda finished: self._finished(batch, finished))

    def _run(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        out = self._product(torch.cat(rows) if len(rows) > 1 else rows[0])
        return list(torch.split(out, [r.shape[0] for r in rows]))

    def _finished(self, batch: list[tuple[torch.Tensor, asyncio.Future[torch.Tensor]]], done: asyncio.Future) -> None:
        self._running = False
        self.batches += 1
        self.rows += sum(hidden.shape[0] for hidden, _ in batch)
        error = None if done.cancelled() else done.exception()
        for index, (_, future) in enumerate(batch):
            if future.done():  # its caller went away
                continue
            if done.cancelled():
                future.cancel()
            elif error is not None:
                future.set_exception(error)
            else:
                future.set_result(done.result()[index])
        if self._queue:
            self._consider()
