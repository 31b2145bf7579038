"""A test-only server whose every request takes a while: the project's own Server with a delay before each
computation, so that a test can kill it while a request or inference step is in flight.

Run as `python slow_server.py DELAY_S serve MODEL --blocks ...` (the arguments of `swarmlm serve`). Before each
forward, backward or inference step it prints BEGAN_LINE, then waits DELAY_S seconds and computes honestly. It
announces a tempting throughput so that a fresh client routes through it first. No production code has this
behaviour: it lives in this file only.
"""

from __future__ import annotations

import asyncio
import sys

from swarmlm.cli import main as cli
from swarmlm.server import backend as backend_module
from swarmlm.server import speed

# printed (and so in the server's log) when a request or step reaches the backend
BEGAN_LINE = "SLOW request began"
# throughput announced: beats honest servers in a fresh client's route costs
TEMPTING_THROUGHPUT = 1e9


def _delayed(method, delay_s: float):  # wraps SpanBackend.run and SpanBackend.step alike
    async def delayed(self, *args, **kwargs):
        print(BEGAN_LINE, flush=True)
        await asyncio.sleep(delay_s)
        return await method(self, *args, **kwargs)

    return delayed


def main() -> int:
    backend, delay_s = backend_module.SpanBackend, float(sys.argv[1])
    backend.run = _delayed(backend.run, delay_s)
    backend.step = _delayed(backend.step, delay_s)
    backend.measure_throughput = lambda self, *args, **kwargs: TEMPTING_THROUGHPUT
    backend.measure_inference_throughput = lambda self, *args, **kwargs: TEMPTING_THROUGHPUT
    # measured every start, never from the speeds kept on this machine (those are honest servers' figures)
    speed.known_speed = lambda folder, key, measure, remeasure=False: speed.Speed(*measure(), speed.MEASURED_NOW, 0.0)
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
