"""Children started by spawn_bound outlive the thread that started them, and still die with this process."""

from __future__ import annotations

import sys
import threading
import time

from swarmlm.utils.processes import spawn_bound


def test_a_child_started_from_a_short_lived_thread_outlives_the_thread() -> None:
    started = []
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    thread = threading.Thread(target=lambda: started.append(spawn_bound(sleeper)))
    thread.start()
    thread.join()
    child = started[0]
    try:
        time.sleep(1.0)  # a parent-death signal tied to the finished thread would have arrived by now
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
