"""Benchmark: LoRA training steps/s (forward + backward + Adam, batch 4x64) through a 2-server loopback swarm against
local PEFT on the same model in one process (same weights, same LoraConfig, fp32)."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from peft import LoraConfig, get_peft_model
from training import BATCH, SEQ  # bench/ is on the path when a benchmark runs as a script
from transformers import AutoModelForCausalLM

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.models.loading import DEFAULT_MODEL, load_config, resolve_model
from swarmlm.tools.local_swarm import LocalSwarm, even_spans

RANK, ALPHA, TARGETS = 8, 16, ("q_proj", "v_proj")


class Steps:
    """Timed Adam steps (forward, backward, update) of one side; the first is a warm-up, not timed."""

    def __init__(self, loss_fn: Callable[[], torch.Tensor], model: torch.nn.Module):
        self.loss_fn = loss_fn
        self.optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        self.durations: list[float] = []
        self.first_loss: float | None = None

    def step(self) -> None:
        began = time.perf_counter()
        loss = self.loss_fn()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        if self.first_loss is None:
            self.first_loss = loss.item()
        else:
            self.durations.append(time.perf_counter() - began)

    def rate(self) -> float:
        """Median steps per second."""
        return 1 / statistics.median(self.durations)


def copy_weights(model: torch.nn.Module, local: torch.nn.Module) -> None:
    """The client's LoRA weights into the local PEFT model."""
    tuning, parameters = model.lora_tuning, dict(local.named_parameters())
    with torch.no_grad():
        for name, a, b in zip(tuning.names(), tuning.lora_A, tuning.lora_B, strict=True):
            parameters[f"{name}.lora_A.default.weight"].copy_(a)
            parameters[f"{name}.lora_B.default.weight"].copy_(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--servers", type=int, default=2)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    config = load_config(model_dir)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    print(f"model {args.model}, LoRA r={RANK} alpha={ALPHA} on {list(TARGETS)}, batch {BATCH}x{SEQ}, fp32, "
          f"torch threads {torch.get_num_threads()} (local and each server)")  # fmt: skip

    base = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    lora_config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0)
    local = get_peft_model(base, lora_config)
    with LocalSwarm(str(model_dir)) as swarm:
        swarm.start_servers(even_spans(config.num_hidden_layers, args.servers))
        torch.manual_seed(0)
        with AutoDistributedModelForCausalLM.from_pretrained(
            str(model_dir), initial_peers=swarm.initial_peers, tuning_mode="lora", lora_rank=RANK, lora_alpha=ALPHA,
            lora_target_modules=TARGETS,
        ) as model:  # fmt: skip
            copy_weights(model, local)  # both start from the same point
            # alternating steps: a change of machine load hits both sides alike
            local_steps = Steps(lambda: local(input_ids=ids, labels=ids).loss, local)
            swarm_steps = Steps(lambda: model(input_ids=ids, labels=ids).loss, model)
            for _ in range(args.repeats + 1):
                local_steps.step()
                swarm_steps.step()
    local_rate, local_loss = local_steps.rate(), local_steps.first_loss
    swarm_rate, swarm_loss = swarm_steps.rate(), swarm_steps.first_loss
    if swarm_loss is None or local_loss is None or abs(swarm_loss - local_loss) > 1e-4:
        raise SystemExit(f"first loss differs: swarm {swarm_loss:.6f}, local {local_loss:.6f}")
    for name, steps in (("local", local_steps), ("swarm", swarm_steps)):
        print(f"{name} step s: median {statistics.median(steps.durations):.2f}, min {min(steps.durations):.2f}, "
              f"max {max(steps.durations):.2f}")  # fmt: skip
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"\n{'metric':<34}{'local':>10}{'swarm':>10}{'ratio (swarm/local)':>22}")
    print(
        f"{'LoRA train steps/s (fwd+bwd)':<34}{local_rate:>10.3f}{swarm_rate:>10.3f}{swarm_rate / local_rate:>22.2f}"
    )


if __name__ == "__main__":
    main()
