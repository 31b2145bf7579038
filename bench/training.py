"""Benchmark: deep prompt tuning steps/s (forward + backward, batch 4x64) through a 2-server loopback swarm against
the same computation in one local process (same weights, fp32): once with servers that keep each forward's graph for
its backward (the default) and once with servers that keep none (--activation-cache-mb 0: the backward recomputes
the forward), back to back."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from targets import line as target_line
from transformers import AutoModelForCausalLM

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.client.prompts import PromptTuning
from swarmlm.models.loading import DEFAULT_MODEL, load_config, resolve_model
from swarmlm.tools.local_swarm import LocalSwarm, even_spans

BATCH, SEQ, PRE_SEQ_LEN = 4, 64, 8


class LocalDeepPtune(torch.nn.Module):
    """Deep prompt tuning in one process: hooks add each block's prompt to the first positions of its input."""

    def __init__(self, model: torch.nn.Module, tuning: PromptTuning):
        super().__init__()
        self.model, self.tuning = model.requires_grad_(False), tuning
        for index, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(self._hook(index))

    def _hook(self, index: int) -> Callable:
        def add_prompt(module: torch.nn.Module, args: tuple) -> tuple:
            hidden = torch.cat(
                [args[0][:, :PRE_SEQ_LEN] + self.tuning.deep_prompts[index], args[0][:, PRE_SEQ_LEN:]], 1
            )
            return (hidden, *args[1:])

        return add_prompt

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        embeds = self.model.model.embed_tokens(input_ids)
        embeds, _, _ = self.tuning.extend(embeds, None, None)
        logits = self.model(inputs_embeds=embeds).logits[:, PRE_SEQ_LEN:].contiguous()
        return self.model.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])


@dataclass
class Phases:
    """Per timed step, in seconds: the loss (forward), zero_grad + backward, the optimizer's step; for a swarm, the
    forward's and the backward's requests by their traces: the whole request and the servers' compute in it."""

    forward: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)
    optimizer: list[float] = field(default_factory=list)
    forward_request: list[float] = field(default_factory=list)
    forward_compute: list[float] = field(default_factory=list)
    backward_request: list[float] = field(default_factory=list)
    backward_compute: list[float] = field(default_factory=list)

    def median_ms(self, name: str) -> float:
        values = getattr(self, name)
        return 1000 * statistics.median(values) if values else float("nan")


def steps_per_s(
    loss_fn: Callable[[], torch.Tensor], params: list, repeats: int, last_trace: Callable[[], Any] | None = None
) -> tuple[float, float, Phases]:
    """Median optimizer steps per second after one warm-up step, the first loss, and where each step's time went."""
    optimizer = torch.optim.Adam(params, lr=1e-3)
    durations, first, phases = [], None, Phases()
    for step in range(repeats + 1):
        began = time.perf_counter()
        loss = loss_fn()
        forward_done = time.perf_counter()
        forward_trace = None if last_trace is None else last_trace()
        optimizer.zero_grad()
        loss.backward()
        backward_done = time.perf_counter()
        backward_trace = None if last_trace is None else last_trace()
        optimizer.step()
        first = loss.item() if first is None else first
        if step:
            durations.append(time.perf_counter() - began)
            phases.forward.append(forward_done - began)
            phases.backward.append(backward_done - forward_done)
            phases.optimizer.append(durations[-1] - (backward_done - began))
            for kind, request in (("forward", forward_trace), ("backward", backward_trace)):
                if request is not None:
                    getattr(phases, f"{kind}_request").append(request.total_ms / 1000)
                    getattr(phases, f"{kind}_compute").append(request.compute_ms / 1000)
    return 1 / statistics.median(durations), first, phases


def print_phases(local: Phases, swarm: dict[str, Phases]) -> None:
    """Where a step's time goes, local against each swarm run (medians, ms)."""
    rows = [
        ("forward (the loss)", "forward"),
        ("  its request through the servers", "forward_request"),
        ("    the servers' compute in it", "forward_compute"),
        ("zero_grad + backward", "backward"),
        ("  its request through the servers", "backward_request"),
        ("    the servers' compute in it", "backward_compute"),
        ("optimizer step", "optimizer"),
    ]
    print(f"\n{'per step, ms (medians)':<40}{'local':>10}" + "".join(f"{label:>16}" for label in swarm))
    for title, name in rows:
        figures = [local.median_ms(name), *(phases.median_ms(name) for phases in swarm.values())]
        print(f"{title:<40}" + "".join(f"{'' if f != f else f'{f:.1f}':>{10 if i == 0 else 16}}"
                                       for i, f in enumerate(figures)))  # fmt: skip
    print(
        "(a request's time less its servers' compute is the wire, the servers' queues and event loops; the rest of "
        "forward and backward is the client's: embeddings, prompts, LM head, loss and their gradients)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    config = load_config(model_dir)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    print(f"model {args.model}, deep_ptune pre_seq_len {PRE_SEQ_LEN}, batch {BATCH}x{SEQ}, fp32, "
          f"torch threads {torch.get_num_threads()} (local and each server)")  # fmt: skip

    torch.manual_seed(0)
    tuning = PromptTuning("deep_ptune", PRE_SEQ_LEN, config.hidden_size, config.num_hidden_layers)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    local = LocalDeepPtune(reference, tuning)
    local_rate, local_loss, local_phases = steps_per_s(
        lambda: local(ids, ids), list(tuning.parameters()), args.repeats
    )

    rates, phases = {}, {}
    for label, cache_mb in (("graphs kept", None), ("recomputed", "0")):
        extra = () if cache_mb is None else ("--activation-cache-mb", cache_mb)
        with LocalSwarm(str(model_dir), extra_args=extra) as swarm:
            swarm.start_servers(even_spans(config.num_hidden_layers, 2))
            torch.manual_seed(0)
            with AutoDistributedModelForCausalLM.from_pretrained(
                str(model_dir), initial_peers=swarm.initial_peers, tuning_mode="deep_ptune", pre_seq_len=PRE_SEQ_LEN
            ) as model:
                params = [p for p in model.parameters() if p.requires_grad]
                rate, loss, phases[label] = steps_per_s(
                    lambda: model(input_ids=ids, labels=ids).loss, params, args.repeats, lambda: model.last_trace
                )
        if abs(loss - local_loss) > 1e-4:
            raise SystemExit(f"first loss differs ({label}): swarm {loss:.6f}, local {local_loss:.6f}")
        rates[label] = rate
    print(f"\n{'train steps/s (fwd+bwd)':<34}{'local':>10}{'swarm':>10}{'ratio (swarm/local)':>22}")
    for label, rate in rates.items():
        print(f"{'swarm, ' + label:<34}{local_rate:>10.3f}{rate:>10.3f}{rate / local_rate:>22.2f}")
    print_phases(local_phases, phases)
    if "graphs kept" in rates:
        print(target_line("deep_prompt", rates["graphs kept"] / local_rate))


if __name__ == "__main__":
    main()
