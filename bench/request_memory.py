"""Benchmark: what one forward or backward request makes a server hold, and what bounding it costs in time.

No swarm: the server's own code path (SpanBackend._run_by_block) over SmolLM2's first --blocks blocks, fp32, one
torch thread, each case in a process of its own (what glibc keeps of one case would lower the next one's figure).
For each request shape it prints the peak RSS above the process's size before the request (VmHWM, reset through
/proc/self/clear_refs) and the compute thread's CPU time of:

- a forward computed in its request's own memory (as a request off the wire is: owned);
- a backward with every block's graph built at once (the way of a backward whose graphs are small);
- a backward that keeps its blocks' inputs and rebuilds one block's graph a group of rows at a time (the way of a
  backward whose graphs would exceed RECOMPUTE_GRAPH_BYTES, server/pieces.py),

and the last two's ratios (memory and time, checkpointed over all graphs at once).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from swarmlm.models.loading import DEFAULT_MODEL, load_config, resolve_model
from swarmlm.models.span import SpanModel
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.server.backend import SpanBackend, whole

WAYS = ("forward", "backward, all graphs", "backward, checkpointed")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field + ":")).split()[1]) / 1024


def measure(way: str, rows: int, seq: int, blocks: int) -> dict[str, float]:
    """One case, in this process: peak MB above the size before, CPU seconds."""
    torch.set_num_threads(1)
    span = SpanModel.from_dir(resolve_model(DEFAULT_MODEL), 0, blocks)
    backend = SpanBackend(span, torch.float32, "cpu", rows * seq)
    backend._recompute_graph_bytes = 0 if way == WAYS[2] else 1 << 62
    hidden_size = span.config.hidden_size
    warm = SpanTensors(torch.randn(1, 8, hidden_size), grad_outputs=torch.randn(1, 8, hidden_size))
    whole(backend._run_by_block(0, blocks, warm, None))  # first-use costs (thread pools, kernels) come before
    hidden = torch.randn(rows, seq, hidden_size)
    grad = None if way == WAYS[0] else torch.randn(rows, seq, hidden_size)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak starts again from here
    before, began = _status_mb("VmRSS"), time.thread_time()
    whole(backend._run_by_block(0, blocks, SpanTensors(hidden, grad_outputs=grad), None, owned=True))
    seconds = time.thread_time() - began
    backend.shutdown()
    return {"peak_mb": _status_mb("VmHWM") - before, "cpu_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=["8x128", "32x256", "1x4096"], help="rows x positions")
    parser.add_argument("--case", nargs=3, metavar=("WAY", "ROWS", "SEQ"), help=argparse.SUPPRESS)  # one case
    args = parser.parse_args()
    if args.case:
        print(json.dumps(measure(args.case[0], int(args.case[1]), int(args.case[2]), args.blocks)))
        return
    hidden_size = load_config(resolve_model(DEFAULT_MODEL)).hidden_size
    print(f"SmolLM2, blocks 0:{args.blocks}, fp32, one thread; peak RSS above the size before, CPU time")
    for shape in args.shapes:
        rows, seq = (int(part) for part in shape.split("x"))
        found = {}
        for way in WAYS:
            command = [sys.executable, __file__, "--blocks", str(args.blocks), "--case", way, str(rows), str(seq)]
            found[way] = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
        mb = rows * seq * hidden_size * 4 / 1e6
        cells = "  ".join(f"{way}: +{f['peak_mb']:.0f} MB {f['cpu_s']:.2f} s" for way, f in found.items())
        everything, checkpointed = found[WAYS[1]], found[WAYS[2]]
        print(f"{shape} ({mb:.1f} MB of hidden states)  {cells}  checkpointed/all graphs: memory "
              f"{checkpointed['peak_mb'] / max(1.0, everything['peak_mb']):.2f}x, time "
              f"{checkpointed['cpu_s'] / everything['cpu_s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
