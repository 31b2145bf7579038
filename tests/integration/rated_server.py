"""A test-only server that announces a given throughput instead of measuring its own: the project's own Server,
computing honestly, whose start-up measurements return the figure given, so that a test can make servers differ in
speed as clients see them before measuring them.

Run as `python rated_server.py TOKENS_PER_S serve MODEL --blocks ...` (the arguments of `swarmlm serve`): it
announces TOKENS_PER_S tokens/s per block for forwards and decode steps alike. No production code has this
behaviour: it lives in this file only.
"""

from __future__ import annotations

import sys

from swarmlm.cli import main as cli
from swarmlm.server import backend as backend_module
from swarmlm.server import speed


def main() -> int:
    backend, throughput = backend_module.SpanBackend, float(sys.argv[1])
    backend.measure_throughput = lambda self, *args, **kwargs: throughput
    backend.measure_inference_throughput = lambda self, *args, **kwargs: throughput
    # measured every start, never from the speeds kept on this machine (those are honest servers' figures)
    speed.known_speed = lambda folder, key, measure, remeasure=False: speed.Speed(*measure(), speed.MEASURED_NOW, 0.0)
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
