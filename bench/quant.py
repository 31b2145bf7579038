"""Benchmark: quantized blocks (`swarmlm serve --quant int8|nf4`) against fp32 on the same checkpoint.

Prints, per mode, the weight memory of one block, the logits' largest difference against fp32 on random tokens
(relative to the largest fp32 logit, the tolerance the README states), how often the top token agrees, the
perplexity on a fixed English passage, and the forward speed of all blocks (the fastest of --repeats, the
modes taking turns) as a ratio to fp32.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from swarmlm.models.loading import DEFAULT_MODEL, resolve_model
from swarmlm.models.quant import QUANT_MODES, module_bytes, quantize
from swarmlm.models.span import SpanModel

# a passage the model has a low perplexity on: quantization error shows as its rise
PASSAGE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after the "
    "engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889."
)


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """exp of the mean next-token cross-entropy; logits (1, T, vocab), ids (1, T)."""
    return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).exp().item()


def fastest_forward_s(spans: list[SpanModel], hidden: torch.Tensor, repeats: int) -> list[float]:
    """Each span's fastest of `repeats` forwards, the spans taking turns: on a shared machine, the runs least slowed
    by other processes, under the same changing load for every span."""
    times = [float("inf")] * len(spans)
    with torch.inference_mode():
        for span in spans:
            span(hidden)  # warm-up
        for _ in range(repeats):
            for i, span in enumerate(spans):
                began = time.perf_counter()
                span(hidden)
                times[i] = min(times[i], time.perf_counter() - began)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--modes", nargs="+", default=list(QUANT_MODES), choices=QUANT_MODES)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="compute threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    blocks = local.config.num_hidden_layers
    exact = SpanModel.from_dir(model_dir, 0, blocks)
    ids = torch.randint(3, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    passage = AutoTokenizer.from_pretrained(model_dir)(PASSAGE, return_tensors="pt").input_ids
    with torch.inference_mode():
        hidden, passage_hidden = local.model.embed_tokens(ids), local.model.embed_tokens(passage)
        expected = local.lm_head(local.model.norm(exact(hidden)))
        exact_ppl = perplexity(local.lm_head(local.model.norm(exact(passage_hidden))), passage)
    largest = expected.abs().max().item()
    spans = [exact]
    for mode in args.modes:
        spans.append(SpanModel.from_dir(model_dir, 0, blocks))
        quantize(spans[-1].layers, mode)
    times = fastest_forward_s(spans, hidden, args.repeats)
    print(f"{args.model}: {blocks} blocks, {args.tokens} random tokens, {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"fp32: {module_bytes(exact.layers[0]) / 1e6:.2f} MB per block, passage perplexity {exact_ppl:.2f}, "
          f"forward of all blocks {times[0] * 1e3:.0f} ms")  # fmt: skip
    for mode, quantized, mode_s in zip(args.modes, spans[1:], times[1:], strict=True):
        with torch.inference_mode():
            logits = local.lm_head(local.model.norm(quantized(hidden)))
            ppl = perplexity(local.lm_head(local.model.norm(quantized(passage_hidden))), passage)
        diff = (logits - expected).abs().max().item()
        agree = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
        print(f"{mode}: {module_bytes(quantized.layers[0]) / 1e6:.2f} MB per block "
              f"({module_bytes(exact.layers[0]) / module_bytes(quantized.layers[0]):.1f}x less); "
              f"logits max |diff| {diff:.3f} against a largest logit of {largest:.1f} ({diff / largest:.1%}), "
              f"same top token at {agree:.0%} of positions; passage perplexity {ppl:.2f}; "
              f"forward of all blocks {mode_s * 1e3:.0f} ms (speed ratio {times[0] / mode_s:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
