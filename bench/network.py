"""Benchmark: greedy decoding and a batched forward through swarms of emulated hosts (swarmlm.tools.netbed) at emulated
round-trip times and link rates, with ratios against one local process (same weights, fp32).

Each server runs on a host of its own behind a link of the given one-way delay (half the RTT) and rate; the client
runs on another host. Needs root and iproute2 (network namespaces). Decode runs compare client-relayed steps, server-
to-server push, and push with speculative decoding by prompt lookup, on a plain chat prompt and on a task whose answer
copies its question; forward runs compare float32, bfloat16 and int8 (per-row scales) on the wire over a rate-capped
link.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from generation import measure  # bench/ is on the path when a benchmark runs as a script
from transformers import AutoModelForCausalLM

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.models.loading import DEFAULT_MODEL, load_config, load_tokenizer, resolve_model
from swarmlm.tools.local_swarm import even_spans
from swarmlm.tools.netbed import hosts
from swarmlm.tools.netbed.swarm import Link, NetSwarm

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# an answer that copies its question: prompt lookup proposes most of it
COPY_PROMPT = (
    "Repeat this text exactly: The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great "
    "lamp, wound the clockwork that turned it, and wrote the weather, the ships he saw and the state of the sea in "
    "his logbook before he went to sleep."
)
LOOKUP_TOKENS = 8  # prompt_lookup_num_tokens of the speculative runs
FORWARD_SHAPE = (8, 128)  # batch x tokens of the forward benchmark


@dataclass(frozen=True)
class Setting:
    servers: int
    rtt_ms: float
    rate_mbit: float = 0.0  # 0: unlimited

    def label(self) -> str:
        rate = f", {self.rate_mbit:g} Mbit/s" if self.rate_mbit else ""
        return f"{self.servers} servers, RTT {self.rtt_ms:g} ms{rate}"


def run_swarm(
    model_dir: str, num_blocks: int, setting: Setting, threads: int, work: object, wire_dtype: str = "float32"
) -> Any:
    """work(connect) in a swarm of `setting`: connect(**client options) gives a connected client (closed after)."""
    link = Link(delay_ms=setting.rtt_ms / 2, rate_mbit=setting.rate_mbit)
    spans = even_spans(num_blocks, setting.servers)
    with NetSwarm(model_dir, max_servers=setting.servers, threads_per_server=threads) as swarm, ExitStack() as stack:

        def connect(**options: Any) -> torch.nn.Module:
            with swarm.client_side():
                model = AutoDistributedModelForCausalLM.from_pretrained(
                    model_dir, initial_peers=swarm.initial_peers, **{"wire_dtype": wire_dtype, **options}
                )
            return stack.enter_context(model)

        swarm.start_servers(spans, [link] * len(spans))
        return work(connect)  # type: ignore[operator]


class TokenClock:
    """A streamer counting tokens as they arrive (speculative decoding delivers several at once)."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, int]] = []
        self.calls = 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls > 1:  # the first call carries the prompt
            self.arrivals.append((time.perf_counter(), value.numel()))

    def end(self) -> None:
        pass

    def tokens_per_s(self) -> float:
        """Tokens after the first arrival over the time since it (time to first token left out, as in decode)."""
        (first, first_count), (last, _) = self.arrivals[0], self.arrivals[-1]
        return (sum(n for _, n in self.arrivals) - first_count) / max(last - first, 1e-9)


def decode_rate(
    model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, repeats: int, **options: Any
) -> tuple[float, list[int]]:
    """Median decode tokens/s of `repeats` greedy generations (after one warm-up), and the tokens generated."""
    rates, output = [], []
    for attempt in range(repeats + 1):
        clock = TokenClock()
        with torch.inference_mode():
            out = model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=clock, **options
            )
        output = out[0].tolist()
        if attempt:
            rates.append(clock.tokens_per_s())
    return statistics.median(rates), output


def forward_tokens_per_s(model: torch.nn.Module, repeats: int) -> float:
    ids = torch.randint(0, 1000, FORWARD_SHAPE, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids[:1, :8])  # warm-up: connections and measurements
        began = time.perf_counter()
        for _ in range(repeats):
            model(ids)
    return repeats * ids.numel() / (time.perf_counter() - began)


def chat(tokenizer: Any, text: str) -> torch.Tensor:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--forward-only", action="store_true", help="skip the decode runs")
    parser.add_argument("--decode-only", action="store_true", help="skip the forward runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the local run and of each server")
    parser.add_argument("--servers", type=int, nargs="+", default=[2, 3], help="swarm sizes of the decode runs")
    parser.add_argument("--rtts", type=float, nargs="+", default=[0, 20, 100], help="round-trip times, ms")
    parser.add_argument("--no-rated", dest="rated", action="store_false", help="skip the 100 Mbit/s decode runs")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still removes its hosts
    torch.set_num_threads(args.threads)
    reason = hosts.unavailable()
    if reason is not None:
        raise SystemExit(f"cannot emulate hosts here: {reason}")
    model_dir = str(resolve_model(args.model))
    num_blocks = load_config(model_dir).num_hidden_layers
    tokenizer = load_tokenizer(model_dir)
    ids = chat(tokenizer, PROMPT)
    local = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    local_rate, _, expected_rows = measure(local, ids, args.new_tokens, args.repeats)
    expected = expected_rows[0]
    local_forward = forward_tokens_per_s(local, args.repeats)

    copy_ids = chat(tokenizer, COPY_PROMPT)
    with torch.inference_mode():
        copy_expected = local.generate(
            copy_ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
        )[0].tolist()
    del local
    print(f"torch threads {args.threads} (local and each server), {args.new_tokens} new tokens, greedy, fp32")
    print(f"local: decode {local_rate:.1f} tokens/s, forward {FORWARD_SHAPE} {local_forward:.0f} tokens/s")
    print(
        "relayed: the client sends each step to every server in turn; push: servers pass it on; +lookup: prompt "
        f"lookup proposes {LOOKUP_TOKENS} tokens a step. Ratios against relayed decoding of the same task."
    )
    modes = [  # (task, label, client options, generate options)
        ("chat", "relayed", {"use_push": False}, {}),
        ("chat", "push", {}, {}),
        ("chat", "push+lookup", {}, {"prompt_lookup_num_tokens": LOOKUP_TOKENS}),
        ("copy", "relayed", {"use_push": False}, {}),
        ("copy", "push", {}, {}),
        ("copy", "push+lookup", {}, {"prompt_lookup_num_tokens": LOOKUP_TOKENS}),
    ]
    print(f"\n{'decode through':<36}{'task':>6}{'mode':>13}{'tokens/s':>10}{'vs local':>9}{'vs relayed':>11}")
    settings = [Setting(n, rtt) for n in args.servers for rtt in args.rtts]
    settings += [Setting(n, 20, 100) for n in args.servers if args.rated]
    if args.forward_only:
        settings = []
    for setting in settings:

        def decode(connect: Any, label: str = setting.label()) -> list[tuple[str, str, float]]:
            clients = {"relayed": connect(use_push=False), "push": connect()}
            rows = []
            for task, mode, client_options, generate_options in modes:
                model = clients["relayed" if client_options.get("use_push") is False else "push"]
                task_ids, expected_ids = (ids, expected) if task == "chat" else (copy_ids, copy_expected)
                rate, output = decode_rate(model, task_ids, args.new_tokens, args.repeats, **generate_options)
                if output != expected_ids:
                    raise SystemExit(f"{label} {task} {mode}: the swarm generated other tokens than the local model")
                rows.append((task, mode, rate))
            return rows

        relayed: dict[str, float] = {}
        for task, mode, rate in run_swarm(model_dir, num_blocks, setting, args.threads, decode):
            relayed.setdefault(task, rate)
            print(f"{setting.label():<36}{task:>6}{mode:>13}{rate:>10.2f}{rate / local_rate:>9.2f}"
                  f"{rate / relayed[task]:>11.2f}", flush=True)  # fmt: skip

    print(f"\n{'forward ' + str(FORWARD_SHAPE) + ' through':<36}{'wire':>10}{'tokens/s':>10}{'ratio':>8}")
    forwards = [(Setting(2, 20), "float32"), (Setting(2, 20, 50), "float32"), (Setting(2, 20, 50), "bfloat16"),
                (Setting(2, 20, 50), "int8")]  # fmt: skip
    for setting, wire in [] if args.decode_only else forwards:

        def forward(connect: Any) -> float:
            return forward_tokens_per_s(connect(), args.repeats)

        rate = run_swarm(model_dir, num_blocks, setting, args.threads, forward, wire)
        print(f"{setting.label():<36}{wire:>10}{rate:>10.0f}{rate / local_forward:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
