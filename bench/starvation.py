"""Benchmark: long work and decode steps sharing one server, each against itself alone.

(1) An honest session's one-token decode steps, p50 and p95, alone and while `--flooders` clients (peer ids of one
host) send `--long-tokens`-token prompt steps to the same server back to back: the ratio of the p50s. (2) An honest
`--long-tokens`-token forward alone and while `--sessions` sessions decode flat out through the same server: the
ratio of its times. The server is the project's own, started as `swarmlm serve` for blocks 0:`--blocks` of SmolLM2
with one compute thread; the clients drive the blocks directly (random hidden states through
`model.model.layers[...]`), so the figures are the server's scheduling, not the client's head. The server runs a
long request in quanta while sessions decode (BatchLimits.quantum_tokens, 256 tokens through one block) and takes
turns between the two kinds of work: the decode p50 should stay within a few quanta of alone and the long forward
within about twice its time alone.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import torch

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.models.loading import DEFAULT_MODEL, load_config, resolve_model
from swarmlm.tools.local_swarm import LocalSwarm

HIDDEN_SEED = 0


def connect(model_dir: str, swarm: LocalSwarm) -> torch.nn.Module:
    return AutoDistributedModelForCausalLM.from_pretrained(
        model_dir, initial_peers=swarm.initial_peers, request_timeout_s=600.0
    )


def decode_gaps(layers: torch.nn.Module, hidden_size: int, steps: int) -> list[float]:
    """Seconds of each of `steps` one-token steps of one session (after a 16-token prompt)."""
    with layers.inference_session(max_length=16 + steps) as session:
        session.step(torch.randn(1, 16, hidden_size))
        gaps = []
        for _ in range(steps):
            began = time.perf_counter()
            session.step(torch.randn(1, 1, hidden_size))
            gaps.append(time.perf_counter() - began)
    return gaps


def in_background(work: Callable[[threading.Event], None], count: int) -> tuple[threading.Event, list]:
    stop = threading.Event()
    threads = [threading.Thread(target=work, args=(stop,), daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return stop, threads


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--blocks", type=int, default=4, help="the server's blocks: 0 to this")
    parser.add_argument("--long-tokens", type=int, default=1024, help="tokens of a long prompt step or forward")
    parser.add_argument("--flooders", type=int, default=3, help="clients sending long prompt steps")
    parser.add_argument("--sessions", type=int, default=8, help="sessions decoding flat out during the forward")
    parser.add_argument("--steps", type=int, default=60, help="decode steps measured")
    args = parser.parse_args()
    model_dir = str(resolve_model(args.model))
    hidden_size = load_config(model_dir).hidden_size
    torch.manual_seed(HIDDEN_SEED)
    with LocalSwarm(model_dir, threads_per_server=1) as swarm:
        swarm.start_servers([(0, args.blocks)])
        honest = connect(model_dir, swarm)
        flooders = [connect(model_dir, swarm) for _ in range(args.flooders)]
        layers = honest.model.layers[0 : args.blocks]
        try:
            decode_gaps(layers, hidden_size, 8)  # warm-up
            alone = decode_gaps(layers, hidden_size, args.steps)

            def flood(stop: threading.Event, model: torch.nn.Module) -> None:
                while not stop.is_set():
                    with model.model.layers[0 : args.blocks].inference_session(max_length=args.long_tokens) as s:
                        s.step(torch.randn(1, args.long_tokens, hidden_size))

            stop, threads = threading.Event(), []
            for model in flooders:
                threads.append(threading.Thread(target=flood, args=(stop, model), daemon=True))
                threads[-1].start()
            time.sleep(1.0)
            flooded = decode_gaps(layers, hidden_size, args.steps)
            stop.set()
            for thread in threads:
                thread.join()

            hidden = torch.randn(1, args.long_tokens, hidden_size)
            with torch.inference_mode():
                layers(hidden)  # warm-up
                began = time.perf_counter()
                layers(hidden)
                forward_alone = time.perf_counter() - began

            def decode_forever(stop: threading.Event) -> None:
                while not stop.is_set():
                    decode_gaps(flooders[0].model.layers[0 : args.blocks], hidden_size, 32)

            stop, threads = in_background(decode_forever, args.sessions)
            time.sleep(1.0)
            with torch.inference_mode():
                began = time.perf_counter()
                layers(hidden)
                forward_flooded = time.perf_counter() - began
            stop.set()
            for thread in threads:
                thread.join()
        finally:
            for model in [honest, *flooders]:
                model.close()
    print(f"server: SmolLM2 blocks 0:{args.blocks}, 1 thread; long work: {args.long_tokens} tokens")
    print(f"decode step alone:                    p50 {p(alone, 50) * 1e3:7.1f} ms  p95 {p(alone, 95) * 1e3:7.1f} ms")
    print(f"decode step, {args.flooders} peers' prompts flood: p50 {p(flooded, 50) * 1e3:7.1f} ms  "
          f"p95 {p(flooded, 95) * 1e3:7.1f} ms  (worst {max(flooded) * 1e3:.0f} ms)")  # fmt: skip
    print(f"ratio (decode p50 under a prompt flood / alone): {p(flooded, 50) / p(alone, 50):.2f}")
    print(f"long forward alone: {forward_alone:.2f} s; while {args.sessions} sessions decode: {forward_flooded:.2f} s")
    print(f"ratio (long forward under a decode flood / alone): {forward_flooded / forward_alone:.2f} (aim: <= 2)")


if __name__ == "__main__":
    main()
