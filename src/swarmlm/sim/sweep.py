"""The load sweep: the same world at several numbers of servers and users, under each placement rule, so the regime
where the rules differ (and where the swarm is full) is visible: rate / bound, per-token p95 and refused users per
cell, as a table (sweep.md, sweep.json) and heat maps (sweep.png)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from swarmlm.sim.report import dumps, summarize
from swarmlm.sim.scenario import Scenario

# servers x users of the default sweep: from a swarm far above its demand to one far below it
SWEEP_SERVERS = (10, 20, 40, 80, 160)
SWEEP_USERS = (500, 1000, 2000, 4000, 8000)
# simulated hours of each cell: long enough for sessions to fill the servers and settle
SWEEP_HOURS = 1.0
SWEEP_RULES = ("swarmlm", "petals")


def cell(scenario: Scenario) -> dict[str, Any]:
    """One cell's figures (runs in a worker process)."""
    from swarmlm.sim.simulation import Simulation

    figures = summarize(scenario, Simulation(scenario).run())
    sessions = figures["sessions"]
    p95 = (figures["latency"]["per_token_s"] or {}).get("p95")
    return {
        "servers": scenario.servers, "users": scenario.clients, "rule": scenario.placement,
        "rate_over_bound": figures["throughput"]["rate_over_bound"], "p95_s": p95,
        "refused_share": round(sessions["users_refused_busy"] / max(1, sessions["chats_started"]), 4),
        "finished_share": sessions["admitted_chats_finished_share"],
    }  # fmt: skip


def run_sweep(base: Scenario, servers: tuple[int, ...], users: tuple[int, ...], rules: tuple[str, ...],
              jobs: int) -> list[dict[str, Any]]:  # fmt: skip
    """Every cell of servers x users x rules, `jobs` at once; in a fixed order whatever the jobs."""
    scenarios = [dataclasses.replace(base, servers=s, clients=u, placement=r)
                 for r in rules for s in servers for u in users]  # fmt: skip
    if jobs == 1:
        return [cell(s) for s in scenarios]
    import multiprocessing

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(cell, scenarios))


def markdown(cells: list[dict[str, Any]], hours: float) -> str:
    lines = [f"# Load sweep ({hours:g} h per cell)", "",
             "Each cell: rate / bound, per-token p95 (s), share of users refused as busy, share of admitted chats "
             "finished.", ""]  # fmt: skip
    for rule in dict.fromkeys(c["rule"] for c in cells):
        mine = [c for c in cells if c["rule"] == rule]
        users = sorted({c["users"] for c in mine})
        lines += [f"## {rule}", "", "| servers \\ users | " + " | ".join(map(str, users)) + " |",
                  "|---|" + "---|" * len(users)]  # fmt: skip
        for servers in sorted({c["servers"] for c in mine}):
            row = {c["users"]: c for c in mine if c["servers"] == servers}
            lines.append(f"| {servers} | " + " | ".join(_cell_text(row[u]) for u in users) + " |")
        lines.append("")
    return "\n".join(lines)


def _cell_text(c: dict[str, Any]) -> str:
    p95 = "-" if c["p95_s"] is None else f"{c['p95_s']:.2g}"
    return f"{c['rate_over_bound']:.2f} / {p95} / {c['refused_share']:.0%} / {c['finished_share']:.0%}"


def heat_map(cells: list[dict[str, Any]], path: Path) -> None:
    """rate / bound and refused share per cell, one row of panels per rule (matplotlib's Agg backend, as plots.py)."""
    from swarmlm.sim import plots

    plots.sweep(cells, path)


def write(cells: list[dict[str, Any]], hours: float, out: Path) -> str:
    text = markdown(cells, hours)
    (out / "sweep.json").write_text(dumps({"hours": hours, "cells": cells}))
    (out / "sweep.md").write_text(text)
    heat_map(cells, out / "sweep.png")
    return text
