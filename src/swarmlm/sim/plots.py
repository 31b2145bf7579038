"""The run's plots: decode rate against its bound over the day, servers per block over time, latency spread."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, and the same pixels on every machine

import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from swarmlm.sim.metrics import Metrics  # noqa: E402
from swarmlm.sim.report import farthest_region, region_name  # noqa: E402
from swarmlm.sim.scenario import Scenario  # noqa: E402


def throughput(runs: dict[str, Metrics], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, m in runs.items():
        hours = [s.t / 3600 for s in m.samples]
        line = ax.plot(hours, [s.tokens_per_s for s in m.samples], label=f"{name}: decode rate")[0]
        bound = [s.bound for s in m.samples]
        ax.plot(hours, bound, linestyle="--", color=line.get_color(), label=f"{name}: bound")
    ax.set_yscale("log")
    ax.set_xlabel("hour")
    ax.set_ylabel("tokens/s")
    ax.set_title("Swarm decode rate and its upper bound")
    ax.legend(fontsize=8)
    _save(fig, path)


def coverage(m: Metrics, name: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if m.samples:
        grid = np.array([s.cover for s in m.samples], dtype=float).T  # (blocks, samples)
        end = m.samples[-1].t / 3600
        image = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", extent=(0, end, 0, grid.shape[0]))
        fig.colorbar(image, ax=ax, label="serving servers")
    else:  # a run shorter than one sample interval
        ax.text(0.5, 0.5, "no sample: the run was shorter than one sample interval", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
    ax.set_xlabel("hour")
    ax.set_ylabel("block")
    ax.set_title(f"Servers per block over time ({name} placement)")
    _save(fig, path)


def latency(scenario: Scenario, runs: dict[str, Metrics], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    far = farthest_region(scenario)
    for name, m in runs.items():
        values = np.frombuffer(m.latency_s, dtype=np.float64)
        weights = np.frombuffer(m.latency_w, dtype=np.int64)
        regions = np.frombuffer(m.latency_region, dtype=np.int8)
        for label, mask in ((name, slice(None)), (f"{name}, {region_name(scenario, far)}", regions == far)):
            v, w = values[mask], weights[mask]
            if len(v) == 0:
                continue
            order = np.argsort(v, kind="stable")
            ax.plot(v[order], np.cumsum(w[order]) / w.sum(), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("per-token latency, s")
    ax.set_ylabel("share of tokens")
    ax.set_title("Per-token latency (cumulative)")
    ax.legend(fontsize=8)
    _save(fig, path)


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_all(scenario: Scenario, runs: dict[str, Metrics], out: Path) -> list[Path]:
    paths = [out / "throughput.png", out / "latency.png"]
    throughput(runs, paths[0])
    latency(scenario, runs, paths[1])
    for name, m in runs.items():
        paths.append(out / f"coverage_{name}.png")
        coverage(m, name, paths[-1])
    return paths


def sweep(cells: list[dict], path: Path) -> None:
    """Heat maps of the load sweep: rate / bound and the share of users refused, servers x users, per rule."""
    rules = list(dict.fromkeys(c["rule"] for c in cells))
    servers = sorted({c["servers"] for c in cells})
    users = sorted({c["users"] for c in cells})
    fig, axes = plt.subplots(len(rules), 2, figsize=(10, 4 * len(rules)), squeeze=False)
    for row, rule in enumerate(rules):
        by = {(c["servers"], c["users"]): c for c in cells if c["rule"] == rule}
        for col, (key, title) in enumerate((("rate_over_bound", "rate / bound"), ("refused_share", "users refused"))):
            grid = np.array([[by[(s, u)][key] for u in users] for s in servers], dtype=float)
            ax = axes[row][col]
            image = ax.imshow(grid, origin="lower", cmap="viridis", vmin=0, vmax=1, aspect="auto")
            ax.set_xticks(range(len(users)), [str(u) for u in users])
            ax.set_yticks(range(len(servers)), [str(s) for s in servers])
            for (i, j), value in np.ndenumerate(grid):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="w", fontsize=8)
            ax.set_xlabel("users")
            ax.set_ylabel("servers")
            ax.set_title(f"{rule}: {title}")
            fig.colorbar(image, ax=ax)
    _save(fig, path)
