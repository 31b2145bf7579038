"""The client's own event loop, on a thread it owns: the one sync edge between PyTorch code and async networking."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An asyncio loop running on a daemon thread; `run()` submits a coroutine and waits for its result, `submit()`
    only starts it."""

    def __init__(self, name: str = "swarmlm-client"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start a coroutine on the loop from any thread, without waiting for it (a closed loop: RuntimeError, and
        the coroutine is closed, never left unawaited)."""
        if self.loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the client's event loop is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run() called from its own loop: await the coroutine instead")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()  # an interrupted caller (Ctrl-C, timeout) must not leave the call running
            raise

    def close(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
