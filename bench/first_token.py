"""Benchmark: where a swarm's time to first token goes, against local generate().

One user's generate() of one new token after a prompt, through a loopback swarm of 2 servers, against the same
weights in one local process (fp32, greedy): the median wall time of each and their ratio, then the swarm's
median breakdown by the client's trace (client/trace.py): each call (the session opens, the prompt's step on each
server) split into the server's compute and the rest (network, queues, the p2p daemons), the opens' time (made all
at once: the longest one's), and the client's time outside the calls (embeddings, the LM head, generate()'s own
work, the session's set-up). Last, each server's prompt step alone: the same blocks' prefill on the prompt's
embeddings in this process, as a server runs it, with no swarm.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from targets import line as target_line
from transformers import AutoModelForCausalLM, DynamicCache

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.models.batched import prefill_batched
from swarmlm.models.loading import DEFAULT_MODEL, load_config, load_tokenizer, resolve_model
from swarmlm.models.span import SpanModel
from swarmlm.tools.local_swarm import LocalSwarm, even_spans

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def first_token_s(model: torch.nn.Module, ids: torch.Tensor) -> float:
    began = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=1, do_sample=False)
    return time.perf_counter() - began


def prefill_alone_ms(model_dir: Path, start: int, end: int, hidden: torch.Tensor, repeats: int) -> float:
    """Median ms of blocks [start, end)'s prompt step on `hidden`, built and run as a server builds and runs them."""
    span = SpanModel.from_dir(model_dir, start, end)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first is a warm-up
            began = time.perf_counter()
            prefill_batched(span, [hidden], [DynamicCache()], start, end)
            times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each (after one warm-up)")
    parser.add_argument(
        "--server-threads", type=int, default=None,
        help="torch threads of each server, and of the prompt steps alone (default: torch's)",
    )  # fmt: skip
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    config = load_config(model_dir)
    ids = load_tokenizer(model_dir)(PROMPT, return_tensors="pt")["input_ids"]

    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    first_token_s(local, ids)
    local_s = statistics.median(first_token_s(local, ids) for _ in range(args.repeats))

    parts: defaultdict[str, list[float]] = defaultdict(list)
    walls = []
    spans = even_spans(config.num_hidden_layers, 2)
    with LocalSwarm(str(model_dir), threads_per_server=args.server_threads) as swarm:
        swarm.start_servers(spans)
        peers = swarm.initial_peers
        with AutoDistributedModelForCausalLM.from_pretrained(str(model_dir), initial_peers=peers) as model:
            first_token_s(model, ids)  # warm-up: routes, connections, the servers' first steps
            for _ in range(args.repeats):
                walls.append(first_token_s(model, ids))
                trace = model.last_trace
                for call in trace.calls:
                    name = f"{call.kind} {call.start}:{call.end}"
                    parts[f"{name} compute"].append(call.compute_ms)
                    parts[f"{name} rest"].append(call.network_ms)
                # a session opens its spans all at once: the opens take the longest one's time
                opens_ms = max((call.total_ms for call in trace.calls if call.kind == "open"), default=0.0)
                parts["opens, all at once"].append(opens_ms)
                steps_ms = sum(call.total_ms for call in trace.calls if call.kind != "open")
                parts["client, outside the calls"].append(walls[-1] * 1000 - opens_ms - steps_ms)
    swarm_s = statistics.median(walls)
    print(f"model {args.model}, {ids.shape[1]}-token prompt, 2 servers, medians of {args.repeats}")
    print(f"time to first token: local {local_s * 1000:.1f} ms, swarm {swarm_s * 1000:.1f} ms "
          f"(ratio swarm/local {swarm_s / local_s:.2f})")  # fmt: skip
    print(target_line("first_token", swarm_s / local_s))
    print("the swarm's time, ms (median of each part; calls in the order they were made):")
    for name, values in parts.items():
        print(f"  {name:<40}{statistics.median(values):>8.1f}")
    with torch.inference_mode():
        hidden = local.get_input_embeddings()(ids)
    if args.server_threads:
        torch.set_num_threads(args.server_threads)
    print(f"each server's prompt step alone, in this process (no swarm; {torch.get_num_threads()} threads), ms:")
    for start, end in spans:
        alone_ms = prefill_alone_ms(Path(model_dir), start, end, hidden, args.repeats)
        print(f"  {f'blocks {start}:{end}':<40}{alone_ms:>8.1f}")


if __name__ == "__main__":
    main()
