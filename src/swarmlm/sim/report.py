"""A run's figures as data (report.json: the same seed gives the same bytes) and as a short Markdown summary."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from swarmlm.sim import scenario as sc
from swarmlm.sim.metrics import Metrics

PERCENTILES = (50, 95, 99)


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def weighted_percentiles(values: np.ndarray, weights: np.ndarray, qs: tuple[int, ...]) -> list[float] | None:
    """Percentiles of `values` where each counts `weights` times (per-token latency of steps of several tokens);
    None without values."""
    if len(values) == 0:
        return None
    order = np.argsort(values, kind="stable")
    ordered, cumulative = values[order], np.cumsum(weights[order])
    picks = [int(np.searchsorted(cumulative, q / 100 * cumulative[-1])) for q in qs]
    return [float(ordered[min(p, len(values) - 1)]) for p in picks]


def _named(values: list[float] | None) -> dict[str, float] | None:
    return None if values is None else {f"p{q}": _round(v) for q, v in zip(PERCENTILES, values, strict=True)}


def farthest_region(scenario: sc.Scenario) -> int:
    """The client region with the longest round trip to the servers, weighted by where servers are."""
    shares = scenario.region_shares
    means = [sum(rtt * share for rtt, share in zip(row, shares, strict=True)) for row in scenario.rtt_ms]
    return max(range(len(means)), key=means.__getitem__)


def region_name(scenario: sc.Scenario, index: int) -> str:
    return sc.REGIONS[index] if len(scenario.rtt_ms) == len(sc.REGIONS) else f"region {index}"


def _latency(scenario: sc.Scenario, metrics: Metrics) -> dict[str, Any]:
    values = np.frombuffer(metrics.latency_s, dtype=np.float64)
    weights = np.frombuffer(metrics.latency_w, dtype=np.int64)
    regions = np.frombuffer(metrics.latency_region, dtype=np.int8)
    far = farthest_region(scenario)
    mask = regions == far
    return {
        "per_token_s": _named(weighted_percentiles(values, weights, PERCENTILES)),
        "farthest_region": region_name(scenario, far),
        "farthest_region_per_token_s": _named(weighted_percentiles(values[mask], weights[mask], PERCENTILES)),
    }


def summarize(scenario: sc.Scenario, metrics: Metrics) -> dict[str, Any]:
    """The headline figures of one run."""
    hours = scenario.hours
    samples = metrics.samples
    rate = [s.tokens_per_s for s in samples]
    bound = [s.bound for s in samples]
    outage = None
    if metrics.outage_t is not None:
        back = None if metrics.recovered_t is None else _round(metrics.recovered_t - metrics.outage_t)
        outage = {"hour": _round(metrics.outage_t / 3600), "servers_lost": metrics.outage_servers,
                  "time_to_full_coverage_s": back}  # fmt: skip
    return {
        "placement": scenario.placement,
        "throughput": {
            "mean_tokens_per_s": _round(float(np.mean(rate))) if rate else 0.0,
            "peak_tokens_per_s": _round(max(rate, default=0.0)),
            "mean_bound_tokens_per_s": _round(float(np.mean(bound))) if bound else 0.0,
            "rate_over_bound": _round(float(np.mean(rate)) / float(np.mean(bound)))
            if rate and np.mean(bound)
            else 0.0,
            "rate_over_bound_by_quarter": quarters(rate, bound),
            "tokens_generated": metrics.tokens_total,
        },
        "latency": _latency(scenario, metrics),
        "coverage": {
            "fraction_of_time_all_blocks_served": _round(metrics.covered_s / (hours * 3600)),
            "outage": outage,
        },  # fmt: skip
        "rebalancing": {
            "moves": len(metrics.moves),
            "moves_per_hour": _round(len(metrics.moves) / hours),
            "sessions_interrupted_by_moves": metrics.interrupted_by_moves,
        },  # fmt: skip
        "sessions": {
            "chats_started": metrics.chats_started,
            "chats_finished": metrics.chats_done,
            "chats_admitted": metrics.chats_admitted,
            "admitted_chats_finished_share": finished_share(metrics),
            "users_refused_busy": metrics.refused,
            "busy_answers": metrics.busy_answers,
            "failed_for_lack_of_room": metrics.failed_busy,
            "failed_while_all_blocks_served": metrics.failed_covered,
            "failed_while_a_block_was_missing": metrics.failed_uncovered,
            "spans_rebuilt": metrics.recoveries,
            "tokens_replayed": metrics.replayed_tokens,
        },
        "training": {"steps": metrics.train_steps, "steps_interrupted": metrics.train_failures},
    }


def quarters(rate: list[float], bound: list[float]) -> list[float]:
    """Mean rate over mean bound in each quarter of the run: a swarm that decays under load shows falling figures."""
    n = len(rate)
    out = []
    for q in range(4):
        part = slice(q * n // 4, (q + 1) * n // 4)
        mean_bound = float(np.mean(bound[part])) if bound[part] else 0.0
        out.append(_round(float(np.mean(rate[part])) / mean_bound) if mean_bound else 0.0)
    return out


def finished_share(metrics: Metrics) -> float:
    """Of the admitted chats that ended (finished or failed) before the run did, the share that finished."""
    ended = metrics.chats_done + metrics.admitted_failed
    return _round(metrics.chats_done / ended) if ended else 1.0


def series(metrics: Metrics) -> dict[str, list[float]]:
    samples = metrics.samples
    return {
        "hour": [_round(s.t / 3600) for s in samples],
        "tokens_per_s": [_round(s.tokens_per_s) for s in samples],
        "bound_tokens_per_s": [_round(s.bound) for s in samples],
        "serving_servers": [s.serving for s in samples],
        "open_chats": [s.generating for s in samples],
    }


def report(scenario: sc.Scenario, runs: dict[str, Metrics]) -> dict[str, Any]:
    """report.json: the scenario, then each placement rule's headline figures and time series."""
    setup = dataclasses.asdict(scenario)
    setup["gpus"] = [dataclasses.asdict(g) for g in scenario.gpus]
    setup["regions"] = list(sc.REGIONS) if len(scenario.rtt_ms) == len(sc.REGIONS) else None
    del setup["placement"]
    return {
        "scenario": setup,
        "bound": "min(weakest block's decode capacity, total capacity / blocks, sessions every block's caches hold at "
        "once / fastest per-token time), each server at the batch its cache holds (at most "
        f"{sc.MAX_BATCH})",
        "runs": {
            name: {**summarize(dataclasses.replace(scenario, placement=name), m), "series": series(m)}
            for name, m in runs.items()
        },  # fmt: skip
    }


def dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, sort_keys=True, allow_nan=False, default=str) + "\n"


ROWS = (
    ("mean decode rate, tokens/s", ("throughput", "mean_tokens_per_s")),
    ("mean decode bound, tokens/s", ("throughput", "mean_bound_tokens_per_s")),
    ("rate / bound", ("throughput", "rate_over_bound")),
    ("rate / bound by quarter of the run", ("throughput", "rate_over_bound_by_quarter")),
    ("per-token latency p50 / p95 / p99, s", ("latency", "per_token_s")),
    ("farthest region's p50 / p95 / p99, s", ("latency", "farthest_region_per_token_s")),
    ("time with every block served", ("coverage", "fraction_of_time_all_blocks_served")),
    ("full coverage again after the outage, s", ("coverage", "outage", "time_to_full_coverage_s")),
    ("moves per hour", ("rebalancing", "moves_per_hour")),
    ("sessions interrupted by moves", ("rebalancing", "sessions_interrupted_by_moves")),
    ("sessions failed while every block was served", ("sessions", "failed_while_all_blocks_served")),
    ("sessions failed during a gap", ("sessions", "failed_while_a_block_was_missing")),
    ("spans rebuilt after failures", ("sessions", "spans_rebuilt")),
    ("chats started / admitted / finished", ("sessions", ("chats_started", "chats_admitted", "chats_finished"))),
    ("admitted chats finished (of those ended)", ("sessions", "admitted_chats_finished_share")),
    ("users refused as busy", ("sessions", "users_refused_busy")),
    ("admitted sessions failed for lack of room", ("sessions", "failed_for_lack_of_room")),
)


def _cell(run: dict[str, Any], path: tuple[Any, ...]) -> str:
    value: Any = run
    for key in path:
        if isinstance(key, tuple):  # several figures of one section, shown together
            return " / ".join(str(value.get(k)) for k in key)
        value = None if value is None else value.get(key)
    if isinstance(value, list):
        return " / ".join(f"{v:.3g}" for v in value)
    if isinstance(value, dict):
        return " / ".join(f"{v:.3g}" for v in value.values())
    if isinstance(value, float):
        return f"{value:.4g}"
    return "never" if value is None else str(value)


def markdown(data: dict[str, Any]) -> str:
    s = data["scenario"]
    names = list(data["runs"])
    lines = [
        f"# swarmlm simulate: {s['servers']} servers, {s['clients']} users, {s['hours']:g} h (seed {s['seed']})",
        "",
        f"Model: {s['num_blocks']} blocks. Outage: {s['outage_share']:.0%} of the serving servers vanish at hour "
        f"{s['outage_hour']}. Bound: {data['bound']}.",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label, path in ROWS:
        lines.append(f"| {label} | " + " | ".join(_cell(data["runs"][n], path) for n in names) + " |")
    far = data["runs"][names[0]]["latency"]["farthest_region"]
    lines += ["", f"Farthest region: {far}. Plots: throughput.png, coverage_<rule>.png, latency.png.", ""]
    return "\n".join(lines)
