"""Benchmark: many users at once through one loopback swarm, against one local process serving them in turn.

Prints (1) the aggregate greedy decode rate of 1, 4 and 8 users generating different prompts at once through 2
servers (their decode steps batch on the servers, their LM heads on the client), with the p50/p95 gap between a
user's tokens, the time to each user's first token and the CPU time each process spends per token, against local
generate() of the same 8 prompts one after another and as one left-padded batch (what one machine serving the 8
users would reach), and (2) how much one user's decode latency grows while another client runs 2048-token
forward/backward passes through the same servers (the servers run inference steps before forward and backward work,
and split long work into small quanta while sessions decode).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from targets import line as target_line
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


def greedy_batch(model: torch.nn.Module, inputs: list[torch.Tensor], new_tokens: int) -> list[list[int]]:
    """Exactly `new_tokens` greedy tokens of every prompt, all prompts as one left-padded batch."""
    width = max(ids.shape[1] for ids in inputs)
    ids = torch.zeros(len(inputs), width, dtype=torch.long)
    mask = torch.zeros(len(inputs), width, dtype=torch.long)
    for row, prompt in enumerate(inputs):
        ids[row, width - prompt.shape[1] :], mask[row, width - prompt.shape[1] :] = prompt[0], 1
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0
        )
    return out[:, width:].tolist()


def local_rounds(model: torch.nn.Module, inputs: list[torch.Tensor], new_tokens: int) -> tuple[float, float, float]:
    """Local rates of the prompts: one after another (new tokens/s, and decode tokens/s prompt by prompt) and as one
    batch (new tokens/s)."""
    began, clocks = time.perf_counter(), [Gaps() for _ in inputs]
    for ids, clock in zip(inputs, clocks, strict=True):
        greedy(model, ids, new_tokens, clock)
    serial = len(inputs) * new_tokens / (time.perf_counter() - began)
    decode = sum(len(c.times) - 2 for c in clocks) / sum(c.times[-1] - c.times[1] for c in clocks)
    began = time.perf_counter()
    greedy_batch(model, inputs, new_tokens)
    return serial, decode, len(inputs) * new_tokens / (time.perf_counter() - began)


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


def together_on_loop(
    model: torch.nn.Module, inputs: list[torch.Tensor], new_tokens: int
) -> tuple[float, float, list[float], list[list[int]], list[float]]:
    """together(), with every user a coroutine on the client's own loop (model.anext_logits, as `swarmlm api` runs
    its requests) instead of a thread calling generate()."""
    outputs: list[list[int]] = [[] for _ in inputs]
    clocks = [Gaps() for _ in inputs]

    async def user(index: int) -> None:
        ids = inputs[index]
        clocks[index].times.append(time.perf_counter())  # as generate()'s streamer gets the prompt first
        session = model.inference_session(max_length=ids.shape[1] + new_tokens)
        try:
            for _ in range(new_tokens):
                token = (await model.anext_logits(session, ids)).argmax(-1)
                clocks[index].times.append(time.perf_counter())
                outputs[index].append(int(token[0]))
                ids = torch.cat([ids, token[:, None]], dim=1)
        finally:
            await session.aclose()

    async def users() -> None:
        await asyncio.gather(*(user(index) for index in range(len(inputs))))

    began = time.perf_counter()
    model.client.loop.run(users())
    rate = len(inputs) * new_tokens / (time.perf_counter() - began)
    first = [clock.times[1] - began for clock in clocks]
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


def training_load(
    model: torch.nn.Module, tokens: int, stop: threading.Event, passes: list[tuple[float, float]]
) -> None:
    """Forward and backward of (1, tokens) hidden states through all blocks, in a loop until stopped; each pass's
    start and end go to `passes`."""
    hidden_size = model.config.hidden_size
    while not stop.is_set():
        began = time.perf_counter()
        hidden = torch.randn(1, tokens, hidden_size).requires_grad_()
        model.model.layers(hidden).sum().backward()
        passes.append((began, time.perf_counter()))


@dataclass
class Interference:
    alone: list[float]  # one user's median decode gap, s, of each generation with nobody training
    loaded: list[float]  # the same while the trainer runs its passes
    idle_pass_s: float  # the trainer's first pass, nobody decoding
    busy_passes_s: list[float]  # its passes that began and ended while the user decoded


def interference(
    user: torch.nn.Module, trainer: torch.nn.Module, ids: torch.Tensor, new_tokens: int, train_tokens: int,
    rounds: int,
) -> Interference:  # fmt: skip
    """One user's decode gaps alone, then while the trainer loops passes: after the trainer's first pass (nobody
    decoding), the user generates `rounds` times, and on until one whole pass ran while it decoded."""
    alone = [decode_gap(user, ids, new_tokens) for _ in range(rounds)]
    stop, passes = threading.Event(), []
    load = threading.Thread(target=training_load, args=(trainer, train_tokens, stop, passes))
    load.start()
    try:
        while not passes and load.is_alive():
            time.sleep(0.05)
        began, loaded = time.perf_counter(), []
        while load.is_alive() and (len(loaded) < rounds or not any(start >= began for start, _ in passes)):
            loaded.append(decode_gap(user, ids, new_tokens))
        ended = time.perf_counter()
    finally:
        stop.set()
        load.join()
    if not passes or not loaded:
        raise SystemExit("the training client failed")
    busy = [end - start for start, end in passes if start >= began and end <= ended]
    return Interference(alone, loaded, passes[0][1] - passes[0][0], busy)


@dataclass
class UsersRun:
    """Rounds of 1, 4 and 8 users through the swarm, each round after one of the local runs."""

    counts: tuple[int, ...]
    local: list[tuple[float, float, float]] = field(default_factory=list)  # local_rounds of each round
    rates: dict[int, list[float]] = field(default_factory=dict)
    steady: dict[int, list[float]] = field(default_factory=dict)  # while all users decode
    gaps: dict[int, list[float]] = field(default_factory=dict)
    firsts: dict[int, list[float]] = field(default_factory=dict)  # each user's time to its first token
    spent: dict[int, dict[str, float]] = field(default_factory=dict)
    rows: dict[int, list[int]] = field(default_factory=dict)  # head rows, head products
    sizes: dict[int, list[int]] = field(default_factory=dict)  # sessions of each server decode batch

    def __post_init__(self) -> None:
        for table in (self.rates, self.steady, self.gaps, self.firsts, self.sizes):
            table.update({n: [] for n in self.counts})
        self.spent.update({n: {} for n in self.counts})
        self.rows.update({n: [0, 0] for n in self.counts})


def run_users(
    swarm: LocalSwarm, m: torch.nn.Module, local: torch.nn.Module, inputs: list[torch.Tensor],
    expected: list[list[int]], new_tokens: int, repeats: int, on_loop: bool = False,
) -> UsersRun:  # fmt: skip
    """`repeats` rounds of: the local runs, then 1, 4 and 8 users through the swarm (drift of the machine touches
    all alike); the users are threads calling generate(), or coroutines on the client's loop (on_loop)."""
    run = UsersRun((1, 4, len(inputs)))
    head = m._loop_heads if on_loop else m._head_batcher
    users_at_once = together_on_loop if on_loop else together
    for _ in range(repeats):
        run.local.append(local_rounds(local, inputs, new_tokens))
        for users in run.counts:
            before, head_before = cpu_seconds(), (head.batches, head.rows)
            logged = [len(batch_sizes(server.log_path)) for server in swarm.servers]
            rate, decoding, user_gaps, outputs, first = users_at_once(m, inputs[:users], new_tokens)
            after = cpu_seconds()
            if outputs != expected[:users]:
                raise SystemExit("the swarm generated other tokens than the local model")
            run.rates[users].append(rate)
            run.steady[users].append(decoding)
            run.gaps[users].extend(user_gaps)
            run.firsts[users].extend(first)
            for role in after:
                run.spent[users][role] = run.spent[users].get(role, 0.0) + after[role] - before.get(role, 0.0)
            run.rows[users][0] += head.rows - head_before[1]
            run.rows[users][1] += head.batches - head_before[0]
            for server, seen in zip(swarm.servers, logged, strict=True):
                run.sizes[users].extend(batch_sizes(server.log_path)[seen:])
    return run


def print_users(run: UsersRun, new_tokens: int) -> None:
    repeats, counts, many = len(run.local), run.counts, run.counts[-1]
    serial, serial_decode, batched = (statistics.median(values) for values in zip(*run.local, strict=True))
    print(f"\n{'run':<44}{'tokens/s':>10}{'ratio':>7}{'vs batch':>10}{'vs 1 user':>11}{'decoding':>10}"
          f"{'vs 1 user':>11}{'p50 ms':>8}{'p95 ms':>8}")  # fmt: skip
    print(f"{'local, the 8 prompts one after another':<44}{serial:>10.1f}{1.0:>7.2f}{serial / batched:>10.2f}"
          f"{'':>11}{serial_decode:>10.1f}")  # fmt: skip
    print(f"{'local, the 8 prompts as one left-padded batch':<44}{batched:>10.1f}{batched / serial:>7.2f}{1.0:>10.2f}")
    one = statistics.median(run.rates[1]), statistics.median(run.steady[1])
    for users in counts:
        rate, decoding = statistics.median(run.rates[users]), statistics.median(run.steady[users])
        p50, p95 = percentile(run.gaps[users], 0.5), percentile(run.gaps[users], 0.95)
        print(f"{f'swarm (2 servers), {users} user(s) at once':<44}{rate:>10.1f}{rate / serial:>7.2f}"
              f"{rate / batched:>10.2f}{rate / one[0]:>11.2f}{decoding:>10.1f}{decoding / one[1]:>11.2f}"
              f"{p50 * 1000:>8.0f}{p95 * 1000:>8.0f}")  # fmt: skip
    print(f"(tokens/s: new tokens / wall time, prompts included; ratio: to the local run one prompt after another, "
          f"vs batch: to the local batch; decoding: tokens/s while every user is decoding, from the last user's first "
          f"token to the first user's last. Medians of {repeats} rounds; round by round, {many} users vs 1: "
          + ", ".join(f"{b / a:.2f}" for a, b in zip(run.rates[1], run.rates[many], strict=True)) + "; decoding "
          + ", ".join(f"{b / a:.2f}" for a, b in zip(run.steady[1], run.steady[many], strict=True))
          + f"; {many} users vs the local batch: "
          + ", ".join(f"{r / local[2]:.2f}" for r, local in zip(run.rates[many], run.local, strict=True))
          + ")")  # fmt: skip
    if many == 8:
        print(target_line("batched", statistics.median(run.rates[many]) / batched))
    print("time to first token, ms, median / slowest user over the rounds (all prompts sent at once): "
          + ", ".join(f"{n} user(s) {statistics.median(run.firsts[n]) * 1000:.0f} / {max(run.firsts[n]) * 1000:.0f}"
                      for n in counts))  # fmt: skip
    tokens = {n: repeats * n * new_tokens for n in counts}
    cpu = {n: {role: 1000 * s / tokens[n] for role, s in run.spent[n].items()} for n in counts}
    roles = sorted(cpu[many])
    print(f"\nCPU ms per generated token (prompts included), by process: {', '.join(roles)}, total")
    for users, by_role in cpu.items():
        heads = run.rows[users][0] / max(1, run.rows[users][1])
        print(f"  {users} user(s): " + "  ".join(f"{by_role.get(r, 0.0):6.1f}" for r in roles)
              + f"  {sum(by_role.values()):6.1f}   (client LM head: {heads:.1f} rows per product)")  # fmt: skip
    print("sessions per batched decode step on the servers (steps of one session alone not counted):")
    for users, held in run.sizes.items():
        print(f"  {users} user(s): " + (f"{len(held)} batches, median {statistics.median(held):.0f}, at most "
                                      f"{max(held)}" if held else "none"))  # fmt: skip


def print_interference(result: Interference, train_tokens: int) -> None:
    alone, loaded = statistics.median(result.alone), statistics.median(result.loaded)
    busy = statistics.median(result.busy_passes_s) if result.busy_passes_s else float("nan")
    print(f"\ndecode gap of one user, median over {len(result.alone)} / {len(result.loaded)} generations: "
          f"{alone * 1000:.0f} ms alone, {loaded * 1000:.0f} ms while another client runs {train_tokens}-token "
          f"forward/backward passes: ratio {loaded / alone:.2f} (generations: "
          + ", ".join(f"{g * 1000:.0f}" for g in result.loaded) + " ms)")  # fmt: skip
    if train_tokens == 2048:
        print(target_line("interference", loaded / alone))
    print(f"the trainer's pass: {result.idle_pass_s:.1f} s with nobody decoding, {busy:.1f} s while the user decodes "
          f"({len(result.busy_passes_s)} passes)")  # fmt: skip


def load_average() -> str:
    """The machine's load averages (1, 5, 15 minutes): other processes' work skews every figure."""
    return " / ".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--train-tokens", type=int, default=2048, help="tokens of the competing forward/backward")
    parser.add_argument("--server-threads", type=int, default=max(1, (os.cpu_count() or 1) // SERVERS),
                        help="torch threads of each server (default: the cores shared among the servers, as "
                             "`swarmlm demo` shares them)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of the local runs and 1, 4 and 8 users, and generations of the user next to "
                             "the trainer; rates are their medians (rounds vary ~10%%)")  # fmt: skip
    parser.add_argument("--decode-wait-ms", type=float, default=None,
                        help="the servers' --decode-wait-ms (default: theirs; 0 turns the wait off)")  # fmt: skip
    parser.add_argument("--on-loop", action="store_true",
                        help="users as coroutines on the client's loop (as `swarmlm api` runs requests), not threads "
                             "calling generate()")  # fmt: skip
    parser.add_argument("--users-only", action="store_true", help="only the users at once (part 1)")
    parser.add_argument(
        "--interference-only", action="store_true", help="only the user next to a training client (part 2)"
    )
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    num_blocks = load_config(model_dir).num_hidden_layers
    inputs = prompts(model_dir)
    print(
        f"model {args.model}, {len(inputs)} users, {args.new_tokens} new tokens each, greedy, fp32, torch threads "
        f"{torch.get_num_threads()} (client), {args.server_threads} (each server); load average {load_average()}; "
        f"users as {'coroutines on the client loop' if args.on_loop else 'threads calling generate()'}"
    )

    local = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    greedy(local, inputs[0], 4)  # warm-up
    expected = [greedy(local, ids, args.new_tokens) for ids in inputs]

    server_args = [] if args.decode_wait_ms is None else ["--decode-wait-ms", str(args.decode_wait_ms)]
    with LocalSwarm(str(model_dir), threads_per_server=args.server_threads, extra_args=server_args) as swarm:
        swarm.start_servers(even_spans(num_blocks, SERVERS))
        with AutoDistributedModelForCausalLM.from_pretrained(str(model_dir), initial_peers=swarm.initial_peers) as m:
            greedy(m, inputs[0], 4)  # warm-up: routes measured, connections open
            users, result = None, None
            if not args.interference_only:
                users = run_users(swarm, m, local, inputs, expected, args.new_tokens, args.repeats, args.on_loop)
            if not args.users_only:
                with AutoDistributedModelForCausalLM.from_pretrained(
                    str(model_dir), initial_peers=swarm.initial_peers
                ) as trainer:
                    result = interference(m, trainer, inputs[1], args.new_tokens, args.train_tokens, args.repeats)
    if users is not None:
        print_users(users, args.new_tokens)
    if result is not None:
        print_interference(result, args.train_tokens)
    print(f"\nload average at the end: {load_average()} (1 / 5 / 15 minutes; the benchmark itself keeps about 2 busy)")


if __name__ == "__main__":
    main()
