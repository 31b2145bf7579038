"""Benchmark: int8 blocks (`swarmlm serve --quant int8`) against fp32 on the same checkpoint.

Prints the weight memory of one block, the logits' largest difference against fp32 (relative to the largest fp32
logit, the tolerance the README states), how often the top token agrees, and the forward speed of all blocks.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from swarmlm.models.loading import DEFAULT_MODEL, resolve_model
from swarmlm.models.quant import module_bytes, quantize_int8
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
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    blocks = local.config.num_hidden_layers
    exact, quantized = SpanModel.from_dir(model_dir, 0, blocks), SpanModel.from_dir(model_dir, 0, blocks)
    fp32_bytes = module_bytes(quantized.layers[0])
    quantize_int8(quantized.layers)
    int8_bytes = module_bytes(quantized.layers[0])
    ids = torch.randint(3, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        hidden = local.model.embed_tokens(ids)
        logits = [local.lm_head(local.model.norm(span(hidden))) for span in (exact, quantized)]
    largest = logits[0].abs().max().item()
    diff = (logits[0] - logits[1]).abs().max().item()
    agree = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()
    times = [forward_s(span, hidden, args.repeats) for span in (exact, quantized)]
    print(f"{args.model}: {blocks} blocks, {args.tokens} random tokens")
    print(f"weights of one block: fp32 {fp32_bytes / 1e6:.2f} MB, int8 {int8_bytes / 1e6:.2f} MB "
          f"({fp32_bytes / int8_bytes:.1f}x less)")  # fmt: skip
    print(f"logits: max |diff| {diff:.3f} against a largest logit of {largest:.1f} ({diff / largest:.1%}); "
          f"same top token at {agree:.0%} of positions")  # fmt: skip
    print(f"forward of all blocks: fp32 {times[0] * 1e3:.0f} ms, int8 {times[1] * 1e3:.0f} ms "
          f"(int8 speed ratio {times[0] / times[1]:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
