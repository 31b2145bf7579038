"""Benchmark: a day in minutes. A swarm runs for --minutes with servers joining, draining (SIGTERM), crashing
(SIGKILL) and rebalancing, while --clients clients generate greedily and one trains deep prompts.

Prints tokens served, wrong tokens (against a local run of the same weights: must be 0), sessions lost for good
(calls failed while the live servers covered every block: must be 0), the churn, and per server the growth of its RSS
and open file descriptors after warm-up (per hour); writes every sample to soak.csv (and soak.png when matplotlib is
installed) in --out. Exits with status 1 if a token was wrong, a session was lost or a process was left running.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import tempfile
from collections import Counter
from pathlib import Path

from chaos import TINY, model_folder  # bench/ is on the path when a benchmark runs as a script

from swarmlm.models.loading import DEFAULT_MODEL
from swarmlm.tools.soak import Sample, SoakPlan, SoakReport, run_soak


def write_csv(samples: list[Sample], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([field.name for field in dataclasses.fields(Sample)])
        writer.writerows(dataclasses.astuple(s) for s in samples)


def plot(samples: list[Sample], path: Path) -> bool:
    """RSS and descriptors of every server (with its helpers) over time; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (rss, fds) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for server in sorted({s.server for s in samples}, key=lambda name: int(name[1:])):
        mine = [s for s in samples if s.server == server]
        rss.plot([s.t_s / 60 for s in mine], [s.tree_rss_mb for s in mine], label=server)
        fds.plot([s.t_s / 60 for s in mine], [s.tree_fds for s in mine], label=server)
    rss.set_ylabel("RSS, MB (server + DHT + p2pd)")
    fds.set_ylabel("open descriptors")
    fds.set_xlabel("minutes")
    rss.legend(fontsize="small", ncol=4)
    figure.savefig(path, dpi=100)
    return True


def show(report: SoakReport) -> None:
    tally = report.tally
    print(f"\n{report.seconds / 60:.1f} min, {report.plan.clients} generating clients and 1 training")
    print(f"tokens served {tally.tokens} ({tally.tokens / report.seconds:.1f}/s) in {tally.calls} calls")
    print(f"wrong tokens {tally.wrong_tokens}")
    print(f"sessions lost for good {len(tally.lost)} (failed while blocks were uncovered: {tally.uncovered})")
    print(f"training steps {tally.train_steps}")
    kinds = Counter(event for _, event, _ in report.events)
    print(f"events {dict(kinds)}, span moves {report.moves}")
    print(f"processes left running {report.left_running or 'none'}")
    print(f"\ngrowth after warm-up, per hour ({'server':>6s} samples: RSS MB, fds; with DHT and p2pd: RSS MB, fds)")
    for g in report.growth:
        print(f"  {g.server:>6s} {g.samples:4d}: {g.rss_mb_per_h:8.1f} {g.fds_per_h:7.1f}; "
              f"{g.tree_rss_mb_per_h:8.1f} {g.tree_fds_per_h:7.1f}")  # fmt: skip
    for error in tally.lost[:10]:
        print(f"  lost: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"a model name, folder or .gguf, or {TINY!r}")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=8, help="generating clients (one more trains)")
    parser.add_argument("--event-interval", type=float, default=30.0, help="seconds between churn events")
    parser.add_argument("--sample-interval", type=float, default=5.0, help="seconds between RSS/descriptor samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--anchors",
        type=int,
        default=1,
        help="the first servers started never crash or drain, so their samples span the whole run",
    )
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for soak.csv and soak.png")
    args = parser.parse_args()
    if args.minutes <= 0 or args.clients < 1 or args.event_interval <= 0 or args.sample_interval <= 0:
        parser.error("--minutes, --event-interval and --sample-interval must be positive, --clients at least 1")
    plan = SoakPlan(
        args.minutes, args.clients, args.event_interval, args.sample_interval, seed=args.seed, anchors=args.anchors
    )
    with tempfile.TemporaryDirectory(prefix="swarmlm-soak-") as scratch:
        model_dir = model_folder(args.model, Path(scratch))
        print(f"model {args.model}: {plan}", flush=True)
        report = run_soak(model_dir, plan, progress=lambda line: print(line, flush=True))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(report.samples, args.out / "soak.csv")
    plotted = plot(report.samples, args.out / "soak.png")
    show(report)
    print(f"samples in {args.out / 'soak.csv'}" + (f", plot in {args.out / 'soak.png'}" if plotted else ""))
    sys.exit(1 if report.tally.wrong_tokens or report.tally.lost or report.left_running else 0)


if __name__ == "__main__":
    main()
