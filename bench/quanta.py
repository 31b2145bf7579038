"""Benchmark: one server's long forward and backward in whole blocks against chunks of a block's tokens (the quanta a
server runs while sessions decode): the total time of each (its ratio to whole blocks) and the longest and median
quantum, which bound how long a decode step that arrives meanwhile waits. No swarm: the server's own code path
(SpanBackend's pieces) over SmolLM2's first blocks, fp32, one torch thread (a server's share of 2 cores). Times are
the compute thread's CPU time, which other processes on a busy machine change far less than wall time (the wall
time's ratio is printed too)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Generator
from typing import Any

import torch

from swarmlm.models.loading import DEFAULT_MODEL, resolve_model
from swarmlm.models.span import SpanModel
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.server.backend import SpanBackend


def timed(pieces: Generator[None, int | None, Any], quantum: int) -> tuple[list[float], float]:
    """Run a piece generator to its end, `quantum` tokens a piece: the CPU seconds of each piece (on this thread,
    where one torch thread computes) and the wall seconds of all."""
    next(pieces)
    durations, began_wall = [], time.perf_counter()
    while True:
        began = time.thread_time()
        try:
            pieces.send(quantum)
        except StopIteration:
            durations.append(time.thread_time() - began)
            return durations, time.perf_counter() - began_wall
        durations.append(time.thread_time() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--blocks", type=int, default=4, help="blocks of the span (quanta are per block)")
    parser.add_argument("--tokens", type=int, default=2048, help="positions of the one-row request")
    parser.add_argument("--quanta", type=int, nargs="+", default=[512, 256, 128], help="chunk sizes, tokens")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the ways take turns in each")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    span = SpanModel.from_dir(resolve_model(args.model), 0, args.blocks)
    backend = SpanBackend(span, torch.float32, "cpu", 1 << 20)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, args.tokens, span.config.hidden_size, generator=generator)
    requests = {"forward": SpanTensors(hidden), "backward": SpanTensors(hidden, grad_outputs=torch.randn_like(hidden))}
    ways = [0, *args.quanta]
    totals: dict[tuple[str, int], list[float]] = {(kind, q): [] for kind in requests for q in ways}
    walls: dict[tuple[str, int], list[float]] = {(kind, q): [] for kind in requests for q in ways}
    pieces: dict[tuple[str, int], list[float]] = {(kind, q): [] for kind in requests for q in ways}
    timed(backend._run_by_block(0, args.blocks, requests["forward"], None), 0)  # warm-up
    for _ in range(args.repeats):
        for kind, inputs in requests.items():
            for quantum in ways:
                durations, wall = timed(backend._run_by_block(0, args.blocks, inputs, None), quantum)
                totals[kind, quantum].append(sum(durations))
                walls[kind, quantum].append(wall)
                pieces[kind, quantum].extend(durations)
    backend.shutdown()
    print(f"{args.blocks} blocks of {args.model}, 1x{args.tokens} tokens, fp32, {args.threads} torch thread(s), "
          f"medians of {args.repeats} rounds")  # fmt: skip
    print(f"\n{'request':<10}{'quantum':>14}{'CPU s':>8}{'ratio':>8}{'wall ratio':>12}{'quanta':>8}"
          f"{'median ms':>11}{'max ms':>8}")  # fmt: skip
    for kind in requests:
        whole, whole_wall = statistics.median(totals[kind, 0]), statistics.median(walls[kind, 0])
        for quantum in ways:
            total, durations = statistics.median(totals[kind, quantum]), pieces[kind, quantum]
            wall = statistics.median(walls[kind, quantum])
            name = "whole block" if quantum == 0 else f"{quantum} tokens"
            print(f"{kind:<10}{name:>14}{total:>8.2f}{total / whole:>8.3f}{wall / whole_wall:>12.3f}"
                  f"{len(durations) // args.repeats:>8}{statistics.median(durations) * 1000:>11.1f}"
                  f"{max(durations) * 1000:>8.1f}")  # fmt: skip
    print("(CPU time of the compute thread; quanta: per request; median and max: CPU ms of one quantum)")


if __name__ == "__main__":
    main()
