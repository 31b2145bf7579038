"""Benchmark: streaming through the OpenAI-compatible API against calling the Python client directly.

One loopback swarm (2 servers) of SmolLM2; the same greedy chat requests go (a) through `swarmlm api` (a real process,
driven by the official `openai` client with streaming) and (b) straight through the Python client
(AutoDistributedModelForCausalLM.generate with a streamer, in this process), 1 and 8 at once. Prints time to first
token and tokens/s per request (medians) and the ratios API/direct. Both paths produce the same tokens (checked).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import openai
import torch

from swarmlm.api.service import READY_LINE
from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.models.loading import DEFAULT_MODEL, load_config, load_tokenizer, resolve_model
from swarmlm.tools.local_swarm import LocalSwarm, even_spans
from swarmlm.utils.processes import spawn_bound

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
    "What is 12 times 12?", "Who wrote Hamlet?", "What do bees make?", "How many legs has a spider?",
    "What is the boiling point of water?",
]  # fmt: skip


class Clock:
    """A generate() streamer noting when each new token arrives (its first call carries the prompt)."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def figures(began: float, first: float, end: float, tokens: int) -> tuple[float, float]:
    """(time to first token in s, tokens/s after the first token) of one request."""
    return first - began, (tokens - 1) / (end - first) if tokens > 1 and end > first else float("nan")


def direct(model: Any, tokenizer: Any, question: str, new_tokens: int) -> tuple[float, float, str]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    clock = Clock()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, streamer=clock)
    new = out[0, ids.shape[1] :]
    ttft, rate = figures(clock.began, clock.times[1], clock.times[-1], len(new))
    return ttft, rate, tokenizer.decode(new, skip_special_tokens=True)


def through_api(client: openai.OpenAI, name: str, question: str, new_tokens: int) -> tuple[float, float, str]:
    began = time.perf_counter()
    stream = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": question}], max_tokens=new_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    text, first, tokens = "", 0.0, 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    ttft, rate = figures(began, first, time.perf_counter(), tokens)
    return ttft, rate, text


def together(call: Any, users: int) -> list[tuple[float, float, str]]:
    results: list[Any] = [None] * users

    def work(index: int) -> None:
        results[index] = call(QUESTIONS[index])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(users)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def start_api(model_dir: str, name: str, peers: list[str]) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "swarmlm.cli.main", "api", model_dir, "--served-model-name", name, "--port", "0",
            "--initial-peers", *peers]  # fmt: skip
    # it shares the cores with the servers and this process: OpenMP threads spinning after their work would slow them
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
    process = spawn_bound(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(READY_LINE):
            threading.Thread(target=process.stdout.read, daemon=True).start()  # keep its pipe drained
            return process, line[len(READY_LINE) :].strip()
    raise SystemExit(f"`swarmlm api` did not start (exit code {process.wait()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each series (medians over all requests)")
    args = parser.parse_args()
    model_dir = str(resolve_model(args.model))
    tokenizer = load_tokenizer(resolve_model(args.model))
    print(f"model {args.model}, {args.new_tokens} new tokens, greedy, fp32, 2 servers")
    rows = {}
    with LocalSwarm(model_dir) as swarm:
        swarm.start_servers(even_spans(load_config(resolve_model(args.model)).num_hidden_layers, 2))
        api, url = start_api(model_dir, args.model, swarm.initial_peers)
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
            with AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers) as m:
                paths = {
                    "direct": lambda q: direct(m, tokenizer, q, args.new_tokens),
                    "api": lambda q: through_api(client, args.model, q, args.new_tokens),
                }
                for call in paths.values():
                    call(QUESTIONS[0])  # warm-up: routes measured, connections open
                for users in (1, 8):
                    for path, call in paths.items():
                        runs = [r for _ in range(args.repeats) for r in together(call, users)]
                        rows[(path, users)] = runs
                    if [r[2] for r in rows[("api", users)]] != [r[2] for r in rows[("direct", users)]]:
                        raise SystemExit("the API answered other text than the Python client")
        finally:
            api.send_signal(signal.SIGTERM)
            api.wait(60)

    print(f"\n{'users':<7}{'path':<8}{'first token ms':>16}{'tokens/s per request':>22}")
    for (path, users), runs in rows.items():
        ttft = statistics.median(r[0] for r in runs)
        rate = statistics.median(r[1] for r in runs)
        print(f"{users:<7}{path:<8}{ttft * 1000:>16.0f}{rate:>22.1f}")
    for users in (1, 8):
        api_runs, direct_runs = rows[("api", users)], rows[("direct", users)]
        ttft_ratio = statistics.median(r[0] for r in api_runs) / statistics.median(r[0] for r in direct_runs)
        rate_ratio = statistics.median(r[1] for r in api_runs) / statistics.median(r[1] for r in direct_runs)
        print(f"{users} user(s): API/direct time to first token {ttft_ratio:.2f}, tokens/s {rate_ratio:.2f}")


if __name__ == "__main__":
    main()
