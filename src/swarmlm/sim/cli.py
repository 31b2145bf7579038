"""`swarmlm simulate`: flags, the runs (with a progress bar), and the report, its Markdown and plots in --out."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import multiprocessing
import os
import queue
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmlm.checks import COUNT, NON_NEGATIVE, POSITIVE, POSITIVE_INT, PROBABILITY
from swarmlm.cli.args import integer, number
from swarmlm.errors import SwarmError
from swarmlm.sim.scenario import PLACEMENTS, Scenario

if TYPE_CHECKING:
    from swarmlm.sim.metrics import Metrics


def add_parser(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("simulate", help="simulate a large swarm (placement, routing, failures) and report on it")
    sim.add_argument("--servers", type=integer(POSITIVE_INT), default=1000, help="server machines (default: 1000)")
    sim.add_argument(
        "--clients", type=integer(POSITIVE_INT), default=10000, help="users over the run (default: 10000)"
    )
    sim.add_argument("--hours", type=number(POSITIVE), default=24.0, help="simulated hours (default: 24)")
    sim.add_argument("--seed", type=integer(COUNT), default=0, help="random seed: the same seed gives the same report")
    sim.add_argument("--out", required=True, metavar="DIR", help="folder for report.json, report.md and the plots")
    sim.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="swarmlm",
        help="placement rule of the servers: this project's (default), Petals' or random spans",
    )
    sim.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the same scenario under the two other placement rules, side by side (default: yes)",
    )
    sim.add_argument(
        "--jobs",
        type=integer(POSITIVE_INT),
        default=None,
        help="runs at once, one process each (default: one per core, at most one per rule); results do not depend "
        "on it",
    )
    sim.add_argument(
        "--outage-hour",
        type=number(NON_NEGATIVE),
        default=12.0,
        help="hour at which --outage-share of the serving servers vanish at once (default: 12)",
    )
    sim.add_argument(
        "--outage-share",
        type=number(PROBABILITY),
        default=0.3,
        help="share of the serving servers lost in the outage (0: none; default: 0.3)",
    )
    sim.add_argument(
        "--training-share",
        type=number(PROBABILITY),
        default=0.01,
        help="share of the users that are training jobs instead of chats (default: 0.01)",
    )
    sim.add_argument("--step-tokens", type=integer(POSITIVE_INT), default=16,
                     help="tokens simulated as one event (latency stays per token; default: 16)")  # fmt: skip

    sim.add_argument("--sweep", action="store_true",
                     help="also run the load sweep (servers x users, --sweep-hours each, this project's and Petals' "
                     "rules) into sweep.md, sweep.json and sweep.png")  # fmt: skip
    sim.add_argument("--sweep-hours", type=number(POSITIVE), default=1.0,
                     help="simulated hours of each cell of the sweep (default: 1)")  # fmt: skip


def scenario_of(args: argparse.Namespace) -> Scenario:
    return Scenario(servers=args.servers, clients=args.clients, hours=args.hours, seed=args.seed,
                    placement=args.placement, outage_hour=args.outage_hour if args.outage_share > 0 else None,
                    outage_share=args.outage_share, training_share=args.training_share,
                    step_tokens=args.step_tokens)  # fmt: skip


def _out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SwarmError(f"--out {path}: cannot create the folder ({e.strerror or e})") from e
    return out


# what a run in a worker process reports its progress through (set by _start_worker)
_progress: Any = None


def _start_worker(progress: Any) -> None:
    global _progress
    _progress = progress


def _run_in_worker(scenario: Scenario) -> Metrics:
    from swarmlm.sim.simulation import Simulation

    return Simulation(scenario).run(lambda t: _progress.put((scenario.placement, t)))


def _run_all(scenarios: list[Scenario], jobs: int, hours: float) -> dict[str, Metrics]:
    """Each scenario's run (under its placement's name), `jobs` at once in processes of their own (one: here), with
    one progress bar over all of them."""
    from tqdm import tqdm

    from swarmlm.sim.simulation import Simulation

    with tqdm(total=round(hours * len(scenarios), 3), unit="h", desc="simulating", ncols=100) as bar:
        done = dict.fromkeys((s.placement for s in scenarios), 0.0)

        def advance(name: str, t: float) -> None:
            bar.update(round(t / 3600 - done[name], 3))
            done[name] = t / 3600

        if jobs == 1:
            runs = {}
            for scenario in scenarios:
                bar.set_postfix_str(scenario.placement)
                runs[scenario.placement] = Simulation(scenario).run(functools.partial(advance, scenario.placement))
            return runs
        context = multiprocessing.get_context("spawn")  # no state of this process (threads, torch) is inherited
        progress = context.Queue()
        with ProcessPoolExecutor(jobs, mp_context=context, initializer=_start_worker, initargs=(progress,)) as pool:
            futures: dict[str, Future[Metrics]] = {s.placement: pool.submit(_run_in_worker, s) for s in scenarios}
            while not all(future.done() for future in futures.values()) or not progress.empty():
                try:
                    advance(*progress.get(timeout=0.2))
                except queue.Empty:
                    continue
            return {name: future.result() for name, future in futures.items()}


def run(args: argparse.Namespace) -> None:
    from swarmlm.sim import plots
    from swarmlm.sim.report import dumps, markdown, report

    out = _out_dir(args.out)
    base = scenario_of(args)
    names = [args.placement] + ([p for p in PLACEMENTS if p != args.placement] if args.compare else [])
    jobs = min(len(names), args.jobs or os.cpu_count() or 1)
    began, cpu = time.monotonic(), time.process_time()
    runs = _run_all([dataclasses.replace(base, placement=name) for name in names], jobs, args.hours)
    data = report(base, runs)
    (out / "report.json").write_text(dumps(data))
    (out / "report.md").write_text(markdown(data))
    plots.draw_all(base, runs, out)
    print(markdown(data))
    if args.sweep:
        from swarmlm.sim import sweep

        sweep_base = dataclasses.replace(base, hours=args.sweep_hours, outage_hour=None)
        cells = sweep.run_sweep(sweep_base, sweep.SWEEP_SERVERS, sweep.SWEEP_USERS, sweep.SWEEP_RULES,
                                args.jobs or os.cpu_count() or 1)  # fmt: skip
        print(sweep.write(cells, args.sweep_hours, out))
    workers = "" if jobs == 1 else f" in this process; the runs took more in {jobs} worker processes"
    print(f"Wrote {out}/report.json, report.md and plots in {time.monotonic() - began:.0f} s "
          f"({time.process_time() - cpu:.0f} s of CPU{workers})")  # fmt: skip
