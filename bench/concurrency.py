"""Benchmark: many users at once through one loopback swarm, against one local process serving them in turn.

Prints (1) the aggregate greedy decode rate of 1, 4 and 8 users generating different prompts at once through 2
servers (their decode steps batch on the servers, their LM heads on the client), with the p50/p95 gap between a
user's tokens, the time to each user's first token and the CPU time each process spends per token, against local
generate() of the same 8 prompts one after another, and (2) how much one user's decode latency grows while another
client runs 2048-token forward/backward passes through the same servers (the servers run inference steps before
forward and backward work).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.models.loading import DEFAULT_MODEL, load_config, load_tokenizer, resolve_model
from swarmlm.tools.local_swarm import LocalSwarm, even_spans

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
    "What is 12 times 12?", "Who wrote Hamlet?", "What do bees make?", "How many legs has a spider?",
    "What is the boiling point of water?",
]  # fmt: skip
BATCH_LINE = "inference batch sessions="
SERVERS = 2


def prompts(model_dir: object) -> list[torch.Tensor]:
    tokenizer = load_tokenizer(model_dir)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        for q in QUESTIONS
    ]


def greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, streamer: object = None) -> list[int]:
    """Exactly `new_tokens` greedy tokens: end-of-sequence does not stop the generation. (min_new_tokens would do
    the same with two logits processors that cost the client ~1.3 ms per token, which a user decoding greedily does
    not pay.) The explicit all-ones mask stops transformers inferring one from pad tokens in the prompt."""
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, eos_token_id=[],
            streamer=streamer,
        )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def together(
    model: torch.nn.Module, inputs: list[torch.Tensor], new_tokens: int
) -> tuple[float, float, list[float], list[list[int]], list[float]]:
    """Aggregate new tokens/s of all prompts generated at once (one thread each), the aggregate while all of them
    decode (steady_rate), every user's gaps between tokens, the outputs, and each user's time to its first token."""
    outputs: list[list[int]] = [[] for _ in inputs]
    clocks = [Gaps() for _ in inputs]

    def work(index: int) -> None:
        outputs[index] = greedy(model, inputs[index], new_tokens, clocks[index])

    began = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rate = len(inputs) * new_tokens / (time.perf_counter() - began)
    first = [clock.times[1] - began for clock in clocks]  # times[0]: the prompt, put before generation starts
    return rate, steady_rate(clocks), [gap for clock in clocks for gap in clock.gaps()], outputs, first


def steady_rate(clocks: list[Gaps]) -> float:
    """New tokens/s of all users together while every one of them is decoding: from the moment the last user got
    its first token (every prompt has been processed) to the moment the first user got its last one. Prompts and
    the ramps at either end, where fewer users are decoding, are left out. NaN when that window is empty."""
    tokens = [clock.times[1:] for clock in clocks]  # times[0]: the prompt
    begin, end = max(times[0] for times in tokens), min(times[-1] for times in tokens)
    if end <= begin:
        return float("nan")
    return sum(1 for times in tokens for t in times if begin < t <= end) / (end - begin)


def cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far by this process (the client: all users) and each process it started (servers, the
    DHT daemons), by role."""
    roles: dict[str, float] = {}
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            times, command = process.cpu_times(), " ".join(process.cmdline())
        except psutil.Error:
            continue
        role = "client" if process.pid == me.pid else "server" if " serve " in command else "p2p daemons"
        if role == "server":
            role = f"server {command.split('--blocks ')[1].split()[0]}"
        roles[role] = roles.get(role, 0.0) + times.user + times.system
    return roles


def batch_sizes(log_path: Path) -> list[int]:
    """Sessions of each batched decode step a server logged so far, in order."""
    lines = log_path.read_text(errors="replace").splitlines()
    return [int(line.split(BATCH_LINE)[1].split()[0]) for line in lines if BATCH_LINE in line]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Gaps:
    """A streamer recording the time between new tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def gaps(self) -> list[float]:
        """Gaps between new tokens (the first two calls carry the prompt and the first token)."""
        return [b - a for a, b in zip(self.times[2:], self.times[3:], strict=False)]

    def median_gap_s(self) -> float:
        return statistics.median(self.gaps())


def decode_gap(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> float:
    gaps = Gaps()
    greedy(model, ids, new_tokens, gaps)
    return gaps.median_gap_s()


def training_load(model: torch.nn.Module, tokens: int, stop: threading.Event, passes: list[float]) -> None:
    """Forward and backward of (1, tokens) hidden states through all blocks, in a loop until stopped."""
    hidden_size = model.config.hidden_size
    while not stop.is_set():
        began = time.perf_counter()
        hidden = torch.randn(1, tokens, hidden_size).requires_grad_()
        model.model.layers(hidden).sum().backward()
        passes.append(time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--train-tokens", type=int, default=2048, help="tokens of the competing forward/backward")
    parser.add_argument("--server-threads", type=int, default=max(1, (os.cpu_count() or 1) // SERVERS),
                        help="torch threads of each server (default: the cores shared among the servers, as "
                             "`swarmlm demo` shares them)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of 1, 4 and 8 users; rates are their medians (rounds vary ~10%%)")  # fmt: skip
    parser.add_argument("--decode-wait-ms", type=float, default=None,
                        help="the servers' --decode-wait-ms (default: theirs; 0 turns the wait off)")  # fmt: skip
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    num_blocks = load_config(model_dir).num_hidden_layers
    inputs = prompts(model_dir)
    print(f"model {args.model}, {len(inputs)} users, {args.new_tokens} new tokens each, greedy, fp32, torch threads "
          f"{torch.get_num_threads()} (client), {args.server_threads} (each server)")  # fmt: skip

    local = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    greedy(local, inputs[0], 4)  # warm-up
    began, clocks = time.perf_counter(), [Gaps() for _ in inputs]
    expected = [greedy(local, ids, args.new_tokens, clock) for ids, clock in zip(inputs, clocks, strict=True)]
    local_rate = len(inputs) * args.new_tokens / (time.perf_counter() - began)
    local_decode = sum(len(c.times) - 2 for c in clocks) / sum(c.times[-1] - c.times[1] for c in clocks)
    del local

    server_args = [] if args.decode_wait_ms is None else ["--decode-wait-ms", str(args.decode_wait_ms)]
    with LocalSwarm(str(model_dir), threads_per_server=args.server_threads, extra_args=server_args) as swarm:
        swarm.start_servers(even_spans(num_blocks, SERVERS))
        with AutoDistributedModelForCausalLM.from_pretrained(str(model_dir), initial_peers=swarm.initial_peers) as m:
            greedy(m, inputs[0], 4)  # warm-up: routes measured, connections open
            counts = (1, 4, len(inputs))
            rates: dict[int, list[float]] = {n: [] for n in counts}
            steady: dict[int, list[float]] = {n: [] for n in counts}  # while all users decode
            gaps: dict[int, list[float]] = {n: [] for n in counts}
            firsts: dict[int, list[float]] = {n: [] for n in counts}  # each user's time to its first token
            spent: dict[int, dict[str, float]] = {n: {} for n in counts}
            rows: dict[int, list[int]] = {n: [0, 0] for n in counts}  # head rows, head products
            sizes: dict[int, list[int]] = {n: [] for n in counts}  # sessions of each server decode batch
            head = m._head_batcher
            for _ in range(args.repeats):  # rounds of 1, 4, 8 users: drift of the machine touches all alike
                for users in counts:
                    before, head_before = cpu_seconds(), (head.batches, head.rows)
                    logged = [len(batch_sizes(server.log_path)) for server in swarm.servers]
                    rate, decoding, user_gaps, outputs, first = together(m, inputs[:users], args.new_tokens)
                    after = cpu_seconds()
                    if outputs != expected[:users]:
                        raise SystemExit("the swarm generated other tokens than the local model")
                    rates[users].append(rate)
                    steady[users].append(decoding)
                    gaps[users].extend(user_gaps)
                    firsts[users].extend(first)
                    for role in after:
                        spent[users][role] = spent[users].get(role, 0.0) + after[role] - before.get(role, 0.0)
                    rows[users][0] += head.rows - head_before[1]
                    rows[users][1] += head.batches - head_before[0]
                    for server, seen in zip(swarm.servers, logged, strict=True):
                        sizes[users].extend(batch_sizes(server.log_path)[seen:])
            runs = {
                n: (statistics.median(rates[n]), statistics.median(steady[n]), percentile(gaps[n], 0.5),
                    percentile(gaps[n], 0.95))
                for n in counts
            }  # fmt: skip
            tokens = {n: args.repeats * n * args.new_tokens for n in counts}
            cpu = {n: {role: 1000 * s / tokens[n] for role, s in spent[n].items()} for n in counts}
            heads = {n: rows[n][0] / max(1, rows[n][1]) for n in counts}
            alone = decode_gap(m, inputs[1], args.new_tokens)
            with AutoDistributedModelForCausalLM.from_pretrained(
                str(model_dir), initial_peers=swarm.initial_peers
            ) as trainer:
                stop, passes = threading.Event(), []
                load = threading.Thread(target=training_load, args=(trainer, args.train_tokens, stop, passes))
                load.start()
                time.sleep(2.0)  # the first pass is under way
                loaded = decode_gap(m, inputs[1], args.new_tokens)
                stop.set()
                load.join()

    print(f"\n{'run':<40}{'tokens/s':>10}{'ratio':>8}{'vs 1 user':>11}{'decoding':>10}{'vs 1 user':>11}"
          f"{'p50 ms':>8}{'p95 ms':>8}")  # fmt: skip
    print(f"{'local, the 8 prompts one after another':<40}{local_rate:>10.1f}{1.0:>8.2f}{'':>11}{local_decode:>10.1f}")
    for users, (rate, decoding, p50, p95) in runs.items():
        name = f"swarm (2 servers), {users} user(s) at once"
        print(f"{name:<40}{rate:>10.1f}{rate / local_rate:>8.2f}{rate / runs[1][0]:>11.2f}{decoding:>10.1f}"
              f"{decoding / runs[1][1]:>11.2f}{p50 * 1000:>8.0f}{p95 * 1000:>8.0f}")  # fmt: skip
    many = counts[-1]
    print(f"(tokens/s: new tokens / wall time, prompts included; decoding: tokens/s while every user is decoding, "
          f"from the last user's first token to the first user's last. Medians of {args.repeats} rounds; {many} users "
          "vs 1 round by round: "
          + ", ".join(f"{b / a:.2f}" for a, b in zip(rates[1], rates[many], strict=True)) + "; decoding "
          + ", ".join(f"{b / a:.2f}" for a, b in zip(steady[1], steady[many], strict=True)) + ")")  # fmt: skip
    print("time to first token, ms, median / slowest user over the rounds (all prompts sent at once): "
          + ", ".join(f"{n} user(s) {statistics.median(firsts[n]) * 1000:.0f} / {max(firsts[n]) * 1000:.0f}"
                      for n in counts))  # fmt: skip
    roles = sorted(cpu[len(inputs)])
    print(f"\nCPU ms per generated token (prompts included), by process: {', '.join(roles)}, total")
    for users, by_role in cpu.items():
        print(f"  {users} user(s): " + "  ".join(f"{by_role.get(r, 0.0):6.1f}" for r in roles)
              + f"  {sum(by_role.values()):6.1f}   (client LM head: {heads[users]:.1f} rows per product)")  # fmt: skip
    print("sessions per batched decode step on the servers (steps of one session alone not counted):")
    for users, batched in sizes.items():
        print(f"  {users} user(s): " + (f"{len(batched)} batches, median {statistics.median(batched):.0f}, at most "
                                      f"{max(batched)}" if batched else "none"))  # fmt: skip
    print(f"\ndecode gap of one user, median: {alone * 1000:.0f} ms alone, {loaded * 1000:.0f} ms while another client"
          f" runs {args.train_tokens}-token forward/backward passes ({len(passes)} passes, median "
          f"{statistics.median(passes) if passes else float('nan'):.1f} s): ratio {loaded / alone:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
