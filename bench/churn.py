"""Benchmark: a client's decode rate while servers join, leave (SIGTERM: drain) and crash (SIGKILL: rebalance).

Servers choose their blocks (`--num-blocks`); one client generates greedily in a loop the whole time. Prints the
client's tokens/s in each window of a few seconds, with the swarm's events and every server's span, and the number of
generate() calls that failed (the goal is none).
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
from concurrency import Gaps  # bench/ is on the path when a benchmark runs as a script

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.models.loading import DEFAULT_MODEL, load_config, load_tokenizer, resolve_model
from swarmlm.tools.local_swarm import LocalSwarm

# short periods so that a run shows the whole cycle in about a minute
SERVER_ARGS = ["--rebalance-interval", "5", "--announce-interval", "2", "--record-ttl", "6", "--drain-timeout", "5"]


def generate_forever(
    model: torch.nn.Module, ids: torch.Tensor, tokens: Gaps, stop: threading.Event, failures: list[str]
) -> None:
    while not stop.is_set():
        try:
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, streamer=tokens)
        except Exception as e:  # noqa: BLE001 - counted and reported: the benchmark's point is that none happen
            failures.append(f"{type(e).__name__}: {e}")


def spans(swarm: LocalSwarm) -> str:
    alive = [s for s in swarm.servers if s.process.poll() is None]
    return " ".join(f"{s.start}:{s.end}" for s in alive)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--window", type=float, default=5.0, help="seconds per line of the table")
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    num_blocks = load_config(model_dir).num_hidden_layers
    half = num_blocks // 2
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about lighthouses."}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True,
    )["input_ids"]  # fmt: skip
    with LocalSwarm(str(model_dir)) as swarm:
        first = swarm.add_server(num_blocks=half, extra_args=SERVER_ARGS)
        second = swarm.add_server(num_blocks=num_blocks - half, extra_args=SERVER_ARGS)

        def join() -> None:
            swarm.add_server(num_blocks=half, extra_args=SERVER_ARGS)

        # (seconds after the start, what happens)
        events = [
            (10.0, "a third server joins", join),
            (25.0, "the first server crashes (SIGKILL): a survivor must move", lambda: swarm.kill(first)),
            (45.0, "a fourth server joins", join),
            (55.0, "the second server leaves (SIGTERM: drain)", lambda: swarm.stop_server(second)),
            (75.0, "end", lambda: None),
        ]
        with AutoDistributedModelForCausalLM.from_pretrained(str(model_dir), initial_peers=swarm.initial_peers) as m:
            tokens, stop, failures = Gaps(), threading.Event(), []
            worker = threading.Thread(target=generate_forever, args=(m, ids, tokens, stop, failures))
            began = time.perf_counter()
            worker.start()
            print(f"{'time s':>7} {'tokens/s':>9}  spans                 event")
            happened, shown = "", 0.0
            for at, name, action in events:
                while time.perf_counter() - began < at:
                    time.sleep(args.window)
                    now = time.perf_counter() - began
                    count = sum(1 for t in tokens.times if shown <= t - began < now)
                    print(f"{now:>7.0f} {count / (now - shown):>9.1f}  {spans(swarm):<21} {happened}", flush=True)
                    shown, happened = now, ""
                threading.Thread(target=action, daemon=True).start()  # a drain takes seconds: don't stop measuring
                happened = name
            stop.set()
            worker.join(timeout=120)
            for server in swarm.servers:
                code = server.process.poll()
                if code not in (None, 0, -9):  # -9: the SIGKILL above
                    print(f"\nserver {server.start}:{server.end} exited with {code}:\n{server.log_tail(15)}")
    print(f"\ngenerate() calls that failed: {len(failures)}")
    for failure in failures[:5]:
        print("  " + failure[:300])


if __name__ == "__main__":
    main()
