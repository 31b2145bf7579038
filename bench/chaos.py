"""Benchmark: random faults many times. A client generates greedily or trains deep prompts while a random server of a
replicated swarm is SIGKILLed, frozen (SIGSTOP) or cut off (its emulated host's link down) at a random moment.

Prints each trial, then per fault kind: trials, results identical to the fault-free call, trials where the client
noticed the fault, and the worst time to recover (the most seconds a fault added to a call). Needs root (network
namespaces). Exits with status 1 if any trial failed (a wrong result, an error or a hang).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from swarmlm.models.loading import DEFAULT_MODEL, load_config, resolve_model
from swarmlm.tools.chaos import Outcome, run_chaos, summarize

TINY = "tiny"  # --model tiny: a random 5-block Llama (hidden size 64) built for the run


def tiny_model(folder: Path) -> Path:
    """A random Llama with grouped-query attention (4 heads, 2 KV heads) and 5 blocks."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def model_folder(name: str, scratch: Path) -> Path:
    return tiny_model(scratch / "tiny") if name == TINY else resolve_model(name)


def replicated_spans(num_blocks: int, replicas: int) -> list[tuple[int, int]]:
    """Two halves of the blocks, each served by `replicas` servers."""
    half = num_blocks // 2
    return [(0, half)] * replicas + [(half, num_blocks)] * replicas


def show(outcome: Outcome) -> None:
    t = outcome.trial
    verdict = "identical" if outcome.identical else f"FAILED ({outcome.error})"
    victim = f"server {outcome.victim} (...{outcome.victim_peer[-6:]})"
    print(f"trial {t.index:3d}  {t.fault:6s} {t.workload:8s} {victim} at {t.delay_s:5.2f} s  "
          f"{'hit' if outcome.hit else 'missed':6s} {outcome.seconds:6.2f} s (+{outcome.extra_s:5.2f})  {verdict}",
          flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"a model name, folder or .gguf, or {TINY!r}")
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="draws victims, moments and inputs (rerun to repeat)")
    parser.add_argument("--replicas", type=int, default=2, help="servers per half of the blocks")
    args = parser.parse_args()
    if args.trials < 1 or args.replicas < 2:
        parser.error("--trials must be at least 1 and --replicas at least 2 (a fault must leave a replica)")
    with tempfile.TemporaryDirectory(prefix="swarmlm-chaos-") as scratch:
        model_dir = model_folder(args.model, Path(scratch))
        spans = replicated_spans(load_config(model_dir).num_hidden_layers, args.replicas)
        print(f"model {args.model}, servers {spans}, {args.trials} trials, seed {args.seed}", flush=True)
        began = time.monotonic()
        run = run_chaos(model_dir, spans, args.trials, args.seed, report=show)
    for workload, (_, seconds) in run.references.items():
        print(f"fault-free {workload}: {seconds:.2f} s")
    print(f"\n{'fault':8s}{'trials':>8s}{'identical':>11s}{'hit':>6s}{'worst s':>9s}{'worst recovery s':>18s}")
    for row in summarize(run.outcomes):
        print(
            f"{row.fault:8s}{row.trials:8d}{row.identical:11d}{row.hit:6d}{row.worst_s:9.2f}{row.worst_extra_s:18.2f}"
        )
    failed = [o for o in run.outcomes if o.error]
    print(f"\n{len(run.outcomes)} trials in {time.monotonic() - began:.0f} s, {len(failed)} failed (seed {args.seed})")
    for outcome in failed:
        print(f"  trial {outcome.trial.index}: {outcome.trial} -> {outcome.error}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
