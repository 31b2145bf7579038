"""Benchmark: the client's LM head product for a few rows, by torch, by MKL's packed weight and by the rows kernel.

The LM head of SmolLM2-135M (vocabulary x hidden, fp32, 113 MB) multiplies the rows of concurrent decode steps
(client/head_batching.py). Prints, per number of rows, the time of one product by F.linear (the weight as loaded,
row-major), by the copy MKL packs for repeated products, and by the rows kernel's packed copy
(client/rows_kernel.py, which the head batcher uses for up to 12 rows where it was built), and the kernel's time
over MKL's packed one (below 1: the kernel saves time). Each time is the median of --repeats, the ways taking turns.
The kernel runs on one thread whatever --threads says.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from swarmlm.client import rows_kernel
from swarmlm.client.head_batching import pack_weight, packable
from swarmlm.models.loading import DEFAULT_MODEL, load_config, load_tensors, resolve_model
from swarmlm.models.registry import get_family


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1], help="torch threads (the client's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    family = get_family(load_config(model_dir))
    tensors = load_tensors(model_dir, [f"{family.head_name}.", f"{family.embed_name}."], dtype=torch.float32)
    # a model with tied embeddings (SmolLM2) stores no head: it multiplies by the embedding matrix
    weight = tensors.get(f"{family.head_name}.weight", tensors[f"{family.embed_name}.weight"]).contiguous()
    if not packable(weight):
        raise SystemExit("this torch cannot pack the weight (no MKL)")
    packed = pack_weight(weight)
    if packed is None:
        raise SystemExit("MKL's packed product did not match F.linear here")
    kernel = rows_kernel.kernel()
    if kernel is None:
        raise SystemExit("the rows kernel was not built when swarmlm was installed: the head batcher uses MKL")
    mine = kernel.pack(weight)
    print(f"model {args.model}, LM head {tuple(weight.shape)} fp32 ({weight.numel() * 4 / 1e6:.0f} MB); "
          f"ms per product (median of {args.repeats}); the kernel uses {kernel.lanes}-float vectors")  # fmt: skip
    print(f"\n{'threads':>8}{'rows':>6}{'F.linear':>10}{'MKL packed':>12}{'kernel':>8}{'kernel/MKL':>12}")
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                x = torch.randn(rows, weight.shape[1])
                ways = {
                    "usual": lambda x=x: F.linear(x, weight),
                    "mkl": lambda x=x, rows=rows: torch.ops.mkl._mkl_linear(x, packed, weight, None, rows),
                    "kernel": lambda x=x: kernel.product(x, mine),
                }
                times: dict[str, list[float]] = {name: [] for name in ways}
                for _ in range(args.repeats + 2):  # the first two of each are warm-up
                    for name, way in ways.items():
                        began = time.perf_counter()
                        way()
                        times[name].append(time.perf_counter() - began)
                a, b, c = (statistics.median(times[name][2:]) * 1e3 for name in ways)
                print(f"{threads:>8}{rows:>6}{a:>10.2f}{b:>12.2f}{c:>8.2f}{c / b:>12.2f}")


if __name__ == "__main__":
    main()
