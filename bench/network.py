"""Benchmark: greedy decoding and a batched forward through swarms of emulated hosts (swarmlm.netbed) at emulated
round-trip times and link rates, with ratios against one local process (same weights, fp32).

Each server runs on a host of its own behind a link of the given one-way delay (half the RTT) and rate; the client
runs on another host. Needs root and iproute2 (network namespaces); prints decode tokens/s and forward tokens/s.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import dataclass

import torch
from generation import measure  # bench/ is on the path when a benchmark runs as a script
from transformers import AutoModelForCausalLM

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.local_swarm import even_spans
from swarmlm.models.loading import DEFAULT_MODEL, load_config, load_tokenizer, resolve_model
from swarmlm.netbed import hosts
from swarmlm.netbed.swarm import Link, NetSwarm

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
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
) -> float:
    link = Link(delay_ms=setting.rtt_ms / 2, rate_mbit=setting.rate_mbit)
    spans = even_spans(num_blocks, setting.servers)
    with NetSwarm(model_dir, max_servers=setting.servers, threads_per_server=threads) as swarm:
        swarm.start_servers(spans, [link] * len(spans))
        with swarm.client_side():
            model = AutoDistributedModelForCausalLM.from_pretrained(
                model_dir, initial_peers=swarm.initial_peers, wire_dtype=wire_dtype
            )
        with model:
            return work(model)  # type: ignore[operator]


def forward_tokens_per_s(model: torch.nn.Module, repeats: int) -> float:
    ids = torch.randint(0, 1000, FORWARD_SHAPE, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids[:1, :8])  # warm-up: connections and measurements
        began = time.perf_counter()
        for _ in range(repeats):
            model(ids)
    return repeats * ids.numel() / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--forward-only", action="store_true", help="skip the decode runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the local run and of each server")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still removes its hosts
    torch.set_num_threads(args.threads)
    reason = hosts.unavailable()
    if reason is not None:
        raise SystemExit(f"cannot emulate hosts here: {reason}")
    model_dir = str(resolve_model(args.model))
    num_blocks = load_config(model_dir).num_hidden_layers
    tokenizer = load_tokenizer(model_dir)
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    local = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    local_rate, _, expected = measure(local, ids, args.new_tokens, args.repeats)
    local_forward = forward_tokens_per_s(local, args.repeats)
    del local
    print(f"torch threads {args.threads} (local and each server), {args.new_tokens} new tokens, greedy, fp32")
    print(f"local: decode {local_rate:.1f} tokens/s, forward {FORWARD_SHAPE} {local_forward:.0f} tokens/s")

    print(f"\n{'decode through':<36}{'tokens/s':>10}{'ratio':>8}")
    settings = [Setting(n, rtt) for n in (2, 3) for rtt in (0, 20, 100)] + [Setting(n, 20, 100) for n in (2, 3)]
    if args.forward_only:
        settings = []
    for setting in settings:

        def decode(model: torch.nn.Module, label: str = setting.label()) -> float:
            rate, _, output = measure(model, ids, args.new_tokens, args.repeats)
            if output != expected:
                raise SystemExit(f"{label}: the swarm generated other tokens than the local model")
            return rate

        rate = run_swarm(model_dir, num_blocks, setting, args.threads, decode)
        print(f"{setting.label():<36}{rate:>10.2f}{rate / local_rate:>8.2f}", flush=True)

    print(f"\n{'forward ' + str(FORWARD_SHAPE) + ' through':<36}{'wire':>10}{'tokens/s':>10}{'ratio':>8}")
    for setting, wire in [
        (Setting(2, 20), "float32"),
        (Setting(2, 20, 50), "float32"),
        (Setting(2, 20, 50), "bfloat16"),
    ]:
        rate = run_swarm(
            model_dir, num_blocks, setting, args.threads, lambda m: forward_tokens_per_s(m, args.repeats), wire
        )
        print(f"{setting.label():<36}{wire:>10}{rate:>10.0f}{rate / local_forward:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
