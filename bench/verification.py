"""Benchmark: what spot checks cost and how fast they catch a server returning wrong results.

A loopback swarm of SmolLM2-135M (fp32) with two honest servers of all 30 blocks and one test-only server
(tests/integration/hostile_server.py) that is honest, or perturbs its outputs always or on half of its forward
replies. Prints:
1. forward (1x128 tokens, ms) and greedy decode (tokens/s) of a client with checks off and one at the default
   verify_probability, measured after the first requests (always checked) are over, with the ratio on/off;
2. detection latency: requests a fresh client at the default settings makes until it stops using the tampering
   server, over several clients (median, max).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.config import ClientConfig
from swarmlm.models.loading import DEFAULT_MODEL, load_config, resolve_model
from swarmlm.tools.local_swarm import LocalServer, LocalSwarm

HOSTILE_SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "integration" / "hostile_server.py"
OFF = dict(verify_probability=0.0, verify_first_requests=0)
# requests per client before giving up on detection (the default probability catches a half-time liar in ~40)
MAX_REQUESTS = 400


def add_hostile(swarm: LocalSwarm, blocks: int, mode_file: Path) -> LocalServer:
    args = [sys.executable, str(HOSTILE_SCRIPT), str(mode_file), "serve", swarm.model, "--blocks", f"0:{blocks}",
            "--host", "127.0.0.1", "--initial-peers", *swarm.initial_peers, "--num-threads", "1"]  # fmt: skip
    return swarm.add_command(args, 0, blocks, "hostile.log")  # stopped with the swarm


def connect(swarm: LocalSwarm, **options: object) -> torch.nn.Module:
    return AutoDistributedModelForCausalLM.from_pretrained(
        swarm.model, initial_peers=swarm.initial_peers, request_timeout_s=60.0, **options
    )


def forward_ms(model: torch.nn.Module, ids: torch.Tensor, repeats: int) -> float:
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            began = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def decode_rate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> float:
    with torch.inference_mode():
        began = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return new_tokens / (time.perf_counter() - began)


def overhead(swarm: LocalSwarm, repeats: int, new_tokens: int) -> None:
    ids = torch.randint(0, 1000, (1, 128), generator=torch.Generator().manual_seed(0))
    prompt = ids[:, :16]
    with connect(swarm, **OFF) as off, connect(swarm) as on:
        for model in (off, on):  # warm-up: past the first requests, which are always checked
            forward_ms(model, ids, 2 * ClientConfig.verify_first_requests + 2)
            decode_rate(model, prompt, 4)
        fwd = {"off": [], "on": []}
        dec = {"off": [], "on": []}
        for _ in range(3):  # alternate, so that machine load hits both alike
            for name, model in (("off", off), ("on", on)):
                fwd[name].append(forward_ms(model, ids, repeats))
                dec[name].append(decode_rate(model, prompt, new_tokens))
    f_off, f_on = statistics.median(fwd["off"]), statistics.median(fwd["on"])
    d_off, d_on = statistics.median(dec["off"]), statistics.median(dec["on"])
    p = ClientConfig.verify_probability
    print(f"forward 1x128, ms: checks off {f_off:.1f}, on (p={p}) {f_on:.1f}, ratio on/off {f_on / f_off:.2f}")
    print(f"greedy decode, tokens/s: checks off {d_off:.1f}, on (p={p}) {d_on:.1f}, ratio on/off {d_on / d_off:.2f}")


def detection(swarm: LocalSwarm, hostile: LocalServer, mode_file: Path, mode: str, clients: int) -> None:
    mode_file.write_text(mode)
    counts, missed = [], 0
    for seed in range(clients):
        with connect(swarm) as model:
            health = model.model.layers.client.manager.health
            through = 0
            for i in range(MAX_REQUESTS):
                ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(seed * 1000 + i))
                with torch.inference_mode():
                    model(ids)
                through += hostile.peer_id in {c.peer_id for c in model.last_trace.calls if c.kind == "forward"}
                if health.distrusted(hostile.peer_id):
                    counts.append(i + 1)
                    break
            else:
                missed += 1
    shown = f"median {statistics.median(counts):.0f}, max {max(counts)}" if counts else "never"
    print(f"detection ({mode}): requests until the tampering server is dropped: {shown} "
          f"over {len(counts)} clients; not caught within {MAX_REQUESTS} requests: {missed}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per series")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per timed decode")
    parser.add_argument("--clients", type=int, default=5, help="fresh clients per detection series")
    parser.add_argument("--quick", action="store_true", help="smoke check: few repeats, tokens and clients")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.new_tokens, args.clients = 3, 8, 2
    model_dir = str(resolve_model(args.model))
    blocks = load_config(Path(model_dir)).num_hidden_layers
    mode_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    mode_file = mode_dir / f"swarmlm-bench-hostile-{os.getpid()}"
    mode_file.write_text("honest")
    swarm = LocalSwarm(model_dir, threads_per_server=1)
    try:
        swarm.start_servers([(0, blocks), (0, blocks)])
        hostile = add_hostile(swarm, blocks, mode_file)
        overhead(swarm, args.repeats, args.new_tokens)
        detection(swarm, hostile, mode_file, "perturb", args.clients)
        detection(swarm, hostile, mode_file, "perturb_sometimes", args.clients)
    finally:
        swarm.close()
        mode_file.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
