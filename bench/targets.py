"""The targets of the swarm against one local process on the same machine, and where each stood when it was set.

A benchmark that measures one of them prints `line(key, value)` after its table: the run's figure beside the target
and the figure measured when the target was set (2026-12-02, 2-core machines, SmolLM2-135M fp32, 2 loopback servers),
so a run says at once how far it is from the goal and how far it came. docs/benchmarks.md keeps the history.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    what: str
    goal: float
    higher_is_better: bool  # ratios of rates: higher; ratios of times and ms: lower
    when_set: str  # the figure measured when the target was set


TARGETS = {
    "batched": Target(
        "8 users' total tokens/s / one local process decoding the 8 prompts as one batch", 0.95, True, "0.72-0.88"
    ),
    "interference": Target("one user's decode gap next to a 2048-token trainer / alone", 1.5, False, "4.67"),
    "decode": Target("one user's greedy decode tokens/s, 2 servers / local", 0.97, True, "0.88-0.91"),
    "hop": Target(
        "ms per hop of a decode step (its time outside the servers' compute, per message)", 1.0, False, "3.3-5.6"
    ),
    "first_token": Target("time to first token / local", 1.05, False, "1.23-1.34"),
    "forward": Target("forward 8x128 tokens/s / local", 0.97, True, "0.84-0.85"),
    "deep_prompt": Target("deep prompt tuning steps/s / local", 0.90, True, "0.63-0.83"),
}


def met(key: str, value: float) -> bool:
    target = TARGETS[key]
    return value >= target.goal if target.higher_is_better else value <= target.goal


def line(key: str, value: float) -> str:
    """One line: the target, the figure when it was set, this run's and whether it meets the target."""
    target = TARGETS[key]
    sign = ">=" if target.higher_is_better else "<="
    verdict = "met" if met(key, value) else "not met"
    return (
        f"target: {target.what} {sign} {target.goal:g} (when set: {target.when_set}); this run: {value:.2f}, {verdict}"
    )
