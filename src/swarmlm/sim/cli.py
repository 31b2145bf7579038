"""`swarmlm simulate`: flags, the runs (with a progress bar), and the report, its Markdown and plots in --out."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from swarmlm.checks import COUNT, NON_NEGATIVE, POSITIVE, POSITIVE_INT, PROBABILITY
from swarmlm.cli.args import integer, number
from swarmlm.errors import SwarmError
from swarmlm.sim.scenario import PLACEMENTS, Scenario


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
        action="store_true",
        help="also run the same scenario under the two other placement rules, side by side",
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


def run(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from swarmlm.sim import plots
    from swarmlm.sim.report import dumps, markdown, report
    from swarmlm.sim.simulation import Simulation

    out = _out_dir(args.out)
    base = scenario_of(args)
    names = [args.placement] + ([p for p in PLACEMENTS if p != args.placement] if args.compare else [])
    runs = {}
    began, cpu = time.monotonic(), time.process_time()
    with tqdm(total=round(args.hours * len(names), 3), unit="h", desc="simulating", ncols=100) as bar:
        for name in names:
            bar.set_postfix_str(name)
            done = [0.0]

            def advance(t: float, done: list[float] = done) -> None:
                bar.update(round(t / 3600 - done[0], 3))
                done[0] = t / 3600

            runs[name] = Simulation(dataclasses.replace(base, placement=name)).run(advance)
    data = report(base, runs)
    (out / "report.json").write_text(dumps(data))
    (out / "report.md").write_text(markdown(data))
    plots.draw_all(base, runs, out)
    print(markdown(data))
    print(f"Wrote {out}/report.json, report.md and plots in {time.monotonic() - began:.0f} s "
          f"({time.process_time() - cpu:.0f} s of CPU)")  # fmt: skip
