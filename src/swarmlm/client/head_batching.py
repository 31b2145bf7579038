"""The LM head of several generations at once: threads of one client (the API server's requests, users of one model
object) that need logits at the same time get them from one matrix product.

On a CPU, the head of a decode step is bound by reading its weight (vocabulary x hidden: 113 MB for SmolLM2 in
float32), not by arithmetic; rows of concurrent steps stacked into one product read it once. Nothing waits on
purpose: a thread that finds the head idle runs it at once on whatever rows are queued; rows that arrive meanwhile
run together next, as continuous batching does on the servers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch


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

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._queue: list[_Rows] = []
        self._running = False
        self.batches = 0  # products run (for statistics)
        self.rows = 0  # rows they carried

    def __call__(self, head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        mine = _Rows(head, hidden)
        with self._lock:
            self._queue.append(mine)
            while self._running and not mine.done:
                self._lock.wait()
            if not mine.done:  # the head is idle: this thread runs it for everything queued
                batch, self._queue, self._running = self._queue, [], True
        if not mine.done:
            self._run(batch)
        if mine.error is not None:
            raise mine.error
        if mine.result is None:
            raise RuntimeError("the LM head batch ended without this caller's rows")
        return mine.result

    def _run(self, batch: list[_Rows]) -> None:
        try:
            kinds = {(id(rows.head), rows.hidden.dtype, rows.hidden.device, rows.hidden.shape[-1]) for rows in batch}
            if len(kinds) == 1:
                flat = [rows.hidden.reshape(-1, rows.hidden.shape[-1]) for rows in batch]
                with torch.no_grad():
                    out = batch[0].head(torch.cat(flat) if len(flat) > 1 else flat[0])
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
