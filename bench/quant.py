"""Benchmark: quantized blocks (`swarmlm serve --quant int8|nf4`) against fp32 on the same checkpoint.

Prints, per mode, the weight memory of one block, the logits' largest difference against fp32 (relative to the
largest fp32 logit, the tolerance the README states), how often the top token agrees, and the forward speed of all
blocks as a ratio to fp32.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM

from swarmlm.models.loading import DEFAULT_MODEL, resolve_model
from swarmlm.models.quant import QUANT_MODES, module_bytes, quantize
from swarmlm.models.span import SpanModel


def forward_s(span: SpanModel, hidden: torch.Tensor, repeats: int) -> float:
    with torch.inference_mode():
        span(hidden)  # warm-up
        began = time.perf_counter()
        for _ in range(repeats):
            span(hidden)
    return (time.perf_counter() - began) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--modes", nargs="+", default=list(QUANT_MODES), choices=QUANT_MODES)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    blocks = local.config.num_hidden_layers
    exact = SpanModel.from_dir(model_dir, 0, blocks)
    ids = torch.randint(3, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        hidden = local.model.embed_tokens(ids)
        expected = local.lm_head(local.model.norm(exact(hidden)))
    largest = expected.abs().max().item()
    fp32_s = forward_s(exact, hidden, args.repeats)
    print(f"{args.model}: {blocks} blocks, {args.tokens} random tokens; load average {os.getloadavg()[0]:.1f}")
    print(f"fp32: {module_bytes(exact.layers[0]) / 1e6:.2f} MB per block, forward of all blocks {fp32_s * 1e3:.0f} ms")
    for mode in args.modes:
        quantized = SpanModel.from_dir(model_dir, 0, blocks)
        quantize(quantized.layers, mode)
        with torch.inference_mode():
            logits = local.lm_head(local.model.norm(quantized(hidden)))
        diff = (logits - expected).abs().max().item()
        agree = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
        mode_s = forward_s(quantized, hidden, args.repeats)
        print(f"{mode}: {module_bytes(quantized.layers[0]) / 1e6:.2f} MB per block "
              f"({module_bytes(exact.layers[0]) / module_bytes(quantized.layers[0]):.1f}x less); "
              f"logits max |diff| {diff:.3f} against a largest logit of {largest:.1f} ({diff / largest:.1%}), "
              f"same top token at {agree:.0%} of positions; forward of all blocks {mode_s * 1e3:.0f} ms "
              f"(speed ratio {fp32_s / mode_s:.2f})")  # fmt: skip
        del quantized


if __name__ == "__main__":
    main()
