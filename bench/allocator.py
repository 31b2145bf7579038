"""Benchmark: what a server's allocator settings (server/memory.py) cost its compute.

Each setting runs in processes of its own (glibc's mmap threshold is process-wide and, once fixed, stays fixed), the
settings taking turns --rounds times: 15 blocks of the bundled SmolLM2 on a SpanBackend, on its compute thread as a
server runs them, time forwards of 128 and 2048 tokens and one-token decode steps with 128 tokens cached. Prints each
setting's median CPU times over its rounds and their ratio to glibc's default (a threshold that rises to the largest
block freed so far). A ratio above 1 is the setting's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import torch

from swarmlm.models.growing_cache import GrowingCache
from swarmlm.models.loading import DEFAULT_MODEL, load_config, resolve_model
from swarmlm.models.span import SpanModel
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.server import memory
from swarmlm.server.backend import SpanBackend

BLOCKS = 15
FORWARD_TOKENS = (128, 2048)
PAST_TOKENS = 128  # the decode steps' history
DEFAULT = 0  # the setting "glibc's default": no threshold set


async def _timings(backend: SpanBackend, hidden_size: int, repeats: int) -> dict[str, float]:
    """Median seconds of each measured computation, after one warm-up each."""
    found: dict[str, float] = {}
    for tokens in FORWARD_TOKENS:
        inputs = SpanTensors(torch.randn(1, tokens, hidden_size))
        found[f"forward {tokens} tokens"] = await _median(lambda i=inputs: backend.run(0, BLOCKS, i), repeats)
    cache = GrowingCache()
    await backend.step(cache, 0, BLOCKS, SpanTensors(torch.randn(1, PAST_TOKENS, hidden_size)), PAST_TOKENS)
    token = SpanTensors(torch.randn(1, 1, hidden_size))
    step = lambda: backend.step(cache, 0, BLOCKS, token, 1, start_from=PAST_TOKENS)  # noqa: E731 - one line
    found["decode step"] = await _median(step, repeats * 8)
    return found


async def _median(run, repeats: int) -> float:  # noqa: ANN001 - a coroutine factory
    """The median CPU time of the process (all its threads, kernel time included: page faults are the cost looked
    for) over `repeats` runs: on a machine shared with other work, wall time measures the others."""
    await run()
    times = []
    for _ in range(repeats):
        began = time.process_time()
        await run()
        times.append(time.process_time() - began)
    return statistics.median(times)


def worker(threshold_bytes: int, repeats: int, threads: int) -> None:
    """One process's timings under one setting, as a JSON line on stdout."""
    if threshold_bytes != DEFAULT and not memory.map_big_allocations(threshold_bytes):
        raise SystemExit("mallopt is not available here (not glibc)")
    if threads:
        torch.set_num_threads(threads)
    model_dir = resolve_model(DEFAULT_MODEL)
    span = SpanModel.from_dir(model_dir, 0, BLOCKS)
    backend = SpanBackend(span, torch.float32, "cpu", max(FORWARD_TOKENS))
    hidden_size = load_config(model_dir).hidden_size
    with torch.inference_mode():
        found = asyncio.run(_timings(backend, hidden_size, repeats))
    backend.shutdown()
    print(json.dumps(found), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thresholds-kb", type=int, nargs="+", default=[1024, 4096], help="mmap thresholds to try")
    parser.add_argument("--rounds", type=int, default=3, help="processes per setting, the settings taking turns")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per process (decode steps: 8x)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's choice)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.repeats, args.threads)
        return
    settings = [DEFAULT] + [kb << 10 for kb in args.thresholds_kb]
    runs: dict[int, list[dict[str, float]]] = {setting: [] for setting in settings}
    for _ in range(args.rounds):
        for setting in settings:
            command = [sys.executable, __file__, "--worker", str(setting), "--repeats", str(args.repeats)]
            command += ["--threads", str(args.threads)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            runs[setting].append(json.loads(out.strip().splitlines()[-1]))
    _report(runs)


def _report(runs: dict[int, list[dict[str, float]]]) -> None:
    base = {name: statistics.median(run[name] for run in runs[DEFAULT]) for name in runs[DEFAULT][0]}
    for setting, found in runs.items():
        label = "glibc default" if setting == DEFAULT else f"mmap threshold {setting >> 10} KB"
        for name in base:
            median = statistics.median(run[name] for run in found)
            print(f"{label:>26s}  {name:>20s}: {median * 1000:8.2f} ms  x{median / base[name]:.3f} of default")


if __name__ == "__main__":
    main()
