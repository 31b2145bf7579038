"""The speed a server announces: measured warm and in several rounds, once per machine, model and compute dtype, and
kept on disk, so that a restart, a move or a second server on the same machine announces the same figure.

Routing and placement trust announced speeds: a figure that follows the machine's load at the moment of start-up
(other servers loading beside it) swings by orders of magnitude between identical servers, and misleads both.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import filelock
import torch

logger = logging.getLogger(__name__)

# the file of measured speeds in the cache folder; its version changes when the way of measuring does
SPEED_FILE = "speeds_v1.json"
# rounds of a measurement: their median is the figure (a round slowed by a neighbour's burst does not move it)
SPEED_ROUNDS = 5
# a round repeats its computation until it ran this long: one call of a small block takes microseconds, too short
# for the clock and for the noise of one scheduling decision
MIN_ROUND_S = 0.05
# and at most this many times (a computation the clock cannot see would repeat forever)
MAX_RUNS_PER_ROUND = 10_000
# a server waits this long at most for another on this machine that measures the same key, then measures itself: the
# second reads the first's figure, and neither is measured while the other computes
MEASURE_LOCK_TIMEOUT_S = 300.0
# how a figure was found, as the record and the start-up line say
MEASURED_NOW = "measured"
MEASURED_BEFORE = "cached"


@dataclass(frozen=True)
class Speed:
    forward: float  # tokens/s through one block, in forwards of a prompt
    inference: float  # one-token decode steps/s through one block
    source: str  # MEASURED_NOW or MEASURED_BEFORE (on this machine, by an earlier server)
    measured_at: float  # when it was measured (Unix time)


def describe(speed: Speed | None) -> str:
    """How an announced speed was found, for the record and the operator (None: not measured yet, so estimated)."""
    if speed is None:
        return "estimated from the swarm's servers"
    if speed.source == MEASURED_BEFORE:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(speed.measured_at))
        return f"measured on this machine at {when}, kept in the cache"
    return "measured now, kept in the cache"


def median_rate(run: Callable[[], float], work: float, rounds: int = SPEED_ROUNDS) -> float:
    """Units of work per second of `run`, which does `work` units and returns the compute seconds it took: the median
    over rounds, each repeating `run` until it ran MIN_ROUND_S (the first call is a warm-up, not counted)."""
    run()  # first calls allocate
    rates = []
    for _ in range(rounds):
        spent_s, done, runs = 0.0, 0.0, 0
        while spent_s < MIN_ROUND_S and runs < MAX_RUNS_PER_ROUND:
            spent_s += run()
            done, runs = done + work, runs + 1
        rates.append(done / max(spent_s, 1e-9))
    return statistics.median(rates)


def processor_name(device: str) -> str:
    """The model of the device that computes: the GPU's name, or the CPU's (threads matter too: see speed_key)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def speed_key(fingerprint: str, dtype: str, device: str) -> str:
    """What a block's speed depends on: the model, the compute dtype, the processor, the compute threads, torch."""
    return json.dumps([fingerprint, dtype, processor_name(device), torch.get_num_threads(), torch.__version__])


def known_speed(folder: Path, key: str, measure: Callable[[], tuple[float, float]], remeasure: bool = False) -> Speed:
    """The speed under `key`, measured by `measure` ((forward, inference)) only when this machine has none kept in
    `folder` (or remeasure), and then kept. Servers starting together measure one at a time; a cache that cannot be
    read or written is measured around, with a warning."""
    path = folder / SPEED_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(path) + ".lock")
        lock.acquire(timeout=MEASURE_LOCK_TIMEOUT_S)
    except (OSError, filelock.Timeout) as e:
        logger.warning("Measuring this server's speed without the cache in %s: %s", folder, e)
        return _measured(measure)
    try:
        kept = _read(path)
        entry = kept.get(key)
        if entry is not None and not remeasure:
            return Speed(entry["forward"], entry["inference"], MEASURED_BEFORE, entry["measured_at"])
        speed = _measured(measure)
        kept[key] = {"forward": speed.forward, "inference": speed.inference, "measured_at": speed.measured_at}
        _write(path, kept)
        return speed
    finally:
        lock.release()


def _measured(measure: Callable[[], tuple[float, float]]) -> Speed:
    forward, inference = measure()
    return Speed(forward, inference, MEASURED_NOW, time.time())


def _read(path: Path) -> dict[str, dict[str, float]]:
    """The kept speeds by key; entries that are not positive finite numbers are left out (the file is ours, but a
    crash or a hand edit may have broken it)."""
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("Ignoring the speeds kept in %s (unreadable: %s); measuring again", path, e)
        return {}
    if not isinstance(found, dict):
        return {}
    return {key: entry for key, entry in found.items() if _valid(entry)}


def _valid(entry: object) -> bool:
    if not isinstance(entry, dict):
        return False
    values = [entry.get(name) for name in ("forward", "inference", "measured_at")]
    return all(isinstance(v, int | float) and 0 < v < float("inf") for v in values)


def _write(path: Path, kept: dict[str, dict[str, float]]) -> None:
    """Replace the file at once (a reader never sees half of it); a failure is logged: the figure holds anyway."""
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, delete=False) as out:
            json.dump(kept, out, indent=1)
        os.replace(out.name, path)
    except OSError as e:
        logger.warning("Keeping this server's measured speed in %s failed: %s", path, e)
