"""Benchmark: a real loopback swarm overloaded (more users than its servers' session slots) against the simulator's
prediction for the same limits and this machine's measured step costs.

Two one-thread servers of SmolLM2 (blocks 0:15 and 15:30) with `--max-sessions SLOTS`, the per-peer and per-host
shares lifted (loopback users are one peer of one host: else those shares, not the slots, would bind) and
`--alloc-timeout 0` (the simulated servers answer busy at once, they do not wait for room). One client; users arrive
every --arrival-s, each a greedy decode of --new-tokens through `generate()`; a user every server refuses for the
client's busy_wait_s gets SwarmBusyError. The step costs are measured first on the same swarm: one user alone, then
SLOTS users at once. Then the overloaded run, and the simulator's run of the same arrivals (sim/loopback.py's
simulated_overload: the real admission, retry hints, cool-downs and route choice). Printed: the share of users
refused and the admitted users' decode rate (tokens/s, first token to last; their mean), real and simulated, and
the ratios; admitted users' outputs are checked against a local greedy run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from swarmlm.client.model import AutoDistributedModelForCausalLM
from swarmlm.errors import SwarmBusyError
from swarmlm.models.loading import DEFAULT_MODEL, load_config, load_tokenizer, resolve_model
from swarmlm.sim.loopback import Overload, StepCosts, UserOutcome, simulated_overload
from swarmlm.tools.local_swarm import LocalSwarm, even_spans

PROMPTS = ["The capital of France is", "Three primary colors are", "The sky is blue because",
           "Twelve times twelve is", "Hamlet was written by", "Bees make"]  # fmt: skip
# KV-cache tokens per block: room for far more sessions than the slots (the slots are the binding limit)
CACHE_TOKENS = 4096
# a user's whole run (its wait for room, at most busy_wait_s, and its decode) ends within this
USER_DEADLINE_S = 300.0


class TokenClock(BaseStreamer):
    """When each new token came, in seconds since `began` (generate() hands the prompt first: not a token)."""

    def __init__(self, began: float):
        self.began, self.times_s, self._prompt_seen = began, [], False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times_s.append(time.perf_counter() - self.began)
        self._prompt_seen = True

    def end(self) -> None:
        return None


def greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, streamer: BaseStreamer | None = None) -> list:
    """Exactly `new_tokens` greedy tokens (end-of-sequence does not stop it)."""
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=[], streamer=streamer)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


@dataclass
class RealUser:
    outcome: UserOutcome
    tokens: list[int] | None = None  # its output, when admitted
    retry_after_s: float | None = None  # the hint of its SwarmBusyError, when refused


def run_user(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, user: RealUser) -> None:
    began = time.perf_counter()
    clock = TokenClock(began)
    try:
        user.tokens = greedy(model, ids, new_tokens, clock)
    except SwarmBusyError as e:
        user.outcome.refused_after_s, user.retry_after_s = time.perf_counter() - began, e.retry_after_s
    user.outcome.token_times_s = clock.times_s


def run_users(
    model: torch.nn.Module, prompts: list[torch.Tensor], new_tokens: int, arrival_s: float
) -> list[RealUser]:
    """Users starting every arrival_s (a thread each), all run to their end (admitted and done, or refused)."""
    users = [RealUser(UserOutcome(arrived_s=i * arrival_s)) for i in range(len(prompts))]
    threads = [threading.Thread(target=run_user, args=(model, ids, new_tokens, user), daemon=True)
               for ids, user in zip(prompts, users, strict=True)]  # fmt: skip
    began = time.perf_counter()
    for i, thread in enumerate(threads):
        time.sleep(max(0.0, began + i * arrival_s - time.perf_counter()))
        thread.start()
    for thread in threads:
        thread.join(timeout=max(1.0, began + USER_DEADLINE_S - time.perf_counter()))
        if thread.is_alive():
            raise TimeoutError(f"a user did not end within {USER_DEADLINE_S:.0f} s")
    return users


def calibrate(
    model: torch.nn.Module, prompts: list[torch.Tensor], new_tokens: int, blocks: int, slots: int
) -> StepCosts:
    """Step costs from this swarm: a user's per-token time alone, and with `slots` users decoding at once (the
    client's and hops' costs folded into the blocks': on a fixed route only their sum matters)."""
    alone = statistics.median(_per_token_s(run_users(model, prompts[:1], new_tokens, 0.0)) for _ in range(2))
    together = _per_token_s(run_users(model, prompts[:slots], new_tokens, 0.0))
    block_s = alone / blocks
    slope = max(0.0, (together - alone) / (alone * (slots - 1))) if slots > 1 else 0.0
    return StepCosts(block_s=block_s, batch_slope=slope, hop_s=0.0, client_s=0.0)


def _per_token_s(users: list[RealUser]) -> float:
    rates = [u.outcome.tokens_per_s() for u in users]
    if any(rate is None for rate in rates):
        raise RuntimeError("a calibration user was refused or generated too few tokens: raise --slots")
    return statistics.mean(1 / rate for rate in rates if rate)


@dataclass(frozen=True)
class Figures:
    refused_share: float
    admitted_tokens_per_s: float | None  # mean of the admitted users' decode rates
    longest_refusal_s: float | None  # the slowest SwarmBusyError, from the user's start


def figures(outcomes: list[UserOutcome]) -> Figures:
    refused = [o.refused_after_s for o in outcomes if o.refused_after_s is not None]
    rates = [rate for o in outcomes if (rate := o.tokens_per_s()) is not None]
    return Figures(len(refused) / len(outcomes), statistics.mean(rates) if rates else None, max(refused, default=None))


def ratio(real: float | None, simulated: float | None) -> str:
    if not real or simulated is None:
        return "-"
    return f"{simulated / real:.2f}"


def report(real: Figures, sim: Figures, users: list[RealUser], wrong: int) -> None:
    hints = sorted({round(u.retry_after_s, 1) for u in users if u.retry_after_s is not None})
    print(f"{'':34}{'real':>10}{'simulated':>12}{'sim/real':>10}")
    print(f"{'users refused (share)':34}{real.refused_share:>10.2f}{sim.refused_share:>12.2f}"
          f"{ratio(real.refused_share, sim.refused_share):>10}")  # fmt: skip
    print(
        f"{'admitted users, tokens/s (mean)':34}{real.admitted_tokens_per_s or 0:>10.2f}"
        f"{sim.admitted_tokens_per_s or 0:>12.2f}{ratio(real.admitted_tokens_per_s, sim.admitted_tokens_per_s):>10}"
    )
    print(f"{'slowest refusal, s':34}{real.longest_refusal_s or 0:>10.1f}{sim.longest_refusal_s or 0:>12.1f}")
    print(f"retry hints of the refusals, s: {hints}; admitted outputs unlike the local greedy run: {wrong}")


def server_args(slots: int, users: int) -> list[str]:
    return ["--max-sessions", str(slots), "--max-sessions-per-peer", str(users), "--host-share", "1",
            "--peer-cache-share", "1", "--alloc-timeout", "0", "--cache-tokens", str(CACHE_TOKENS)]  # fmt: skip


def run_once(
    args: argparse.Namespace, model_dir: Path, prompts: list[torch.Tensor], expected: list[list[int]]
) -> None:
    blocks = load_config(model_dir).num_hidden_layers
    spans = tuple(even_spans(blocks, 2))
    with LocalSwarm(str(model_dir), threads_per_server=1, extra_args=server_args(args.slots, args.users)) as swarm:
        swarm.start_servers(spans)
        with AutoDistributedModelForCausalLM.from_pretrained(str(model_dir), initial_peers=swarm.initial_peers) as m:
            greedy(m, prompts[0], 2)  # warm-up: routes measured, connections open
            costs = calibrate(m, prompts, args.new_tokens, blocks, args.slots)
            print(f"step costs measured: {costs.block_s * 1000:.2f} ms per block, batch slope {costs.batch_slope:.3f}",
                  flush=True)  # fmt: skip
            users = run_users(m, prompts, args.new_tokens, args.arrival_s)
    overload = Overload(spans, args.slots, args.users, args.arrival_s, max(len(p[0]) for p in prompts),
                        args.new_tokens, CACHE_TOKENS)  # fmt: skip
    simulated = simulated_overload(overload, costs)
    wrong = sum(u.tokens is not None and u.tokens != e for u, e in zip(users, expected, strict=True))
    print(f"load average {' / '.join(f'{v:.2f}' for v in os.getloadavg())} (1 / 5 / 15 min; this run keeps ~2 busy)")
    report(figures([u.outcome for u in users]), figures(simulated), users, wrong)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--slots", type=int, default=2, help="each server's --max-sessions (default: 2)")
    parser.add_argument("--users", type=int, default=12, help="users over the run (default: 12)")
    parser.add_argument("--arrival-s", type=float, default=1.0, help="seconds between two users' starts (default: 1)")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens each user generates (default: 24)")
    parser.add_argument("--repeats", type=int, default=1, help="runs, each on a fresh swarm (default: 1)")
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer(PROMPTS[i % len(PROMPTS)], return_tensors="pt")["input_ids"] for i in range(args.users)]
    # one thread: on a loaded 2-core machine two threads waiting on each other made a small model ten times slower
    torch.set_num_threads(1)
    local = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    distinct = {text: greedy(local, ids, args.new_tokens) for text, ids in zip(PROMPTS, prompts, strict=False)}
    expected = [distinct[PROMPTS[i % len(PROMPTS)]] for i in range(args.users)]
    del local
    print(f"{args.users} users every {args.arrival_s:g} s, {args.new_tokens} new tokens each, on 2 one-thread servers "
          f"of {args.slots} session slots")  # fmt: skip
    for _ in range(args.repeats):
        run_once(args, model_dir, prompts, expected)


if __name__ == "__main__":
    main()
