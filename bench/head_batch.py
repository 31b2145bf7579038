"""Benchmark: the client's LM head product for a few rows, as MKL usually runs it against its packed weight.

The LM head of SmolLM2-135M (vocabulary x hidden, fp32, 113 MB) multiplies the rows of concurrent decode steps
(client/head_batching.py). Prints, per number of rows, the time of one product by F.linear (the weight as loaded,
row-major) and by the packed copy the head batcher makes and uses for all its products, and their ratio (below 1:
packing saves time). Each time is the median of --repeats, the two ways taking turns.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name

from swarmlm.client.head_batching import PACK_ROWS_HINT, pack_weight, packable
from swarmlm.models.loading import DEFAULT_MODEL, load_config, load_tensors, resolve_model
from swarmlm.models.registry import get_family


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1], help="torch threads (the client's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    family = get_family(load_config(model_dir))
    tensors = load_tensors(model_dir, [f"{family.head_name}.", f"{family.embed_name}."], dtype=torch.float32)
    # a model with tied embeddings (SmolLM2) stores no head: it multiplies by the embedding matrix
    weight = tensors.get(f"{family.head_name}.weight", tensors[f"{family.embed_name}.weight"]).contiguous()
    if not packable(weight):
        raise SystemExit("this torch cannot pack the weight (no MKL): the head batcher uses F.linear for all products")
    packed = pack_weight(weight)
    if packed is None:
        raise SystemExit("MKL's packed product did not match F.linear here: the head batcher uses F.linear")
    print(f"model {args.model}, LM head {tuple(weight.shape)} fp32 ({weight.numel() * 4 / 1e6:.0f} MB); the head "
          f"batcher packs it for {PACK_ROWS_HINT} rows and uses it for all; ms per product (median of {args.repeats})")
    print(f"\n{'threads':>8}{'rows':>6}{'F.linear':>10}{'packed':>9}{'ratio':>8}")
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                x = torch.randn(rows, weight.shape[1])
                usual, mkl = [], []
                for _ in range(args.repeats + 2):  # the first two of each are warm-up
                    began = time.perf_counter()
                    F.linear(x, weight)
                    usual.append(time.perf_counter() - began)
                    began = time.perf_counter()
                    torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)
                    mkl.append(time.perf_counter() - began)
                a, b = statistics.median(usual[2:]) * 1e3, statistics.median(mkl[2:]) * 1e3
                print(f"{threads:>8}{rows:>6}{a:>10.2f}{b:>9.2f}{b / a:>8.2f}")


if __name__ == "__main__":
    main()
