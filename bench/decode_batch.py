"""Benchmark: one server's batched decode step against its sessions' steps one by one, by history length.

A server's span (half of SmolLM2's blocks, fp32, one torch thread by default) holds sessions with `--past` cached
tokens each; prints, per history length and number of sessions, the time of one batched decode step (every session
adds one token, decode_batched) against the same sessions stepping one after another through the span alone, and
their ratio (below 1: the batch saves time). Each time is the fastest of --repeats, the two ways taking turns.
--row-major stores the Linear weights as checkpoints do, instead of the column-major layout servers use on a CPU;
--hf-cache gives the sessions Hugging Face's DynamicCache (which copies a layer's history at every step) instead of
the servers' GrowingCache. Then, for fresh sessions' prompts of about --prompt-tokens each, the time of one forward of
all of them (prefill_batched, as a server joins prompts that wait at the same time) against one by one.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers.cache_utils import DynamicCache

from swarmlm.models.batched import decode_batched, prefill_batched
from swarmlm.models.growing_cache import GrowingCache
from swarmlm.models.loading import DEFAULT_MODEL, load_config, resolve_model
from swarmlm.models.span import SpanModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a server's share of the cores)")
    parser.add_argument("--past", type=int, nargs="+", default=[60, 500, 1500], help="cached tokens per session")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--row-major", action="store_true", help="Linear weights row-major, as stored")
    parser.add_argument("--hf-cache", action="store_true", help="sessions in DynamicCache, not GrowingCache")
    parser.add_argument("--prompt-tokens", type=int, default=37, help="tokens of each fresh session's prompt (about)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    blocks = load_config(model_dir).num_hidden_layers // 2
    span = SpanModel.from_dir(model_dir, 0, blocks)
    if args.row_major:
        for module in span.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight = torch.nn.Parameter(module.weight.detach().contiguous(), requires_grad=False)
    layout = "row-major" if args.row_major else "column-major"
    cache_kind = "DynamicCache" if args.hf_cache else "GrowingCache"
    hidden_size = span.config.hidden_size
    print(
        f"model {args.model}, blocks 0:{blocks} (fp32, {layout} Linear weights), sessions in {cache_kind}, "
        f"{args.threads} torch thread(s); ms per decode step"
    )
    print(f"\n{'cached tokens':>14}{'sessions':>10}{'batched':>10}{'one by one':>12}{'ratio':>8}")
    with torch.inference_mode():
        for past in args.past:
            for count in args.sessions:
                caches = []
                for i in range(count):  # histories of slightly different lengths, as real sessions have
                    cache = DynamicCache() if args.hf_cache else GrowingCache()
                    span(torch.randn(1, past + i, hidden_size), cache=cache)
                    caches.append(cache)
                batched = alone = float("inf")
                for _ in range(args.repeats):
                    tokens = [torch.randn(1, 1, hidden_size) for _ in caches]
                    began = time.perf_counter()
                    decode_batched(span, tokens, caches, 0, blocks)
                    batched = min(batched, time.perf_counter() - began)
                    began = time.perf_counter()
                    for token, cache in zip(tokens, caches, strict=True):
                        span(token, cache=cache)
                    alone = min(alone, time.perf_counter() - began)
                print(f"{past:>14}{count:>10}{batched * 1000:>10.1f}{alone * 1000:>12.1f}{batched / alone:>8.2f}")
        print(f"\nprompts of fresh sessions, ms: all in one forward against one by one (fastest of {args.repeats})")
        print(f"{'prompt tokens':>14}{'sessions':>10}{'together':>10}{'one by one':>12}{'ratio':>8}")
        for count in args.sessions:
            # prompts of slightly different lengths, as real users' are
            prompts = [torch.randn(1, args.prompt_tokens + i % 5 - 2, hidden_size) for i in range(count)]
            together = alone = float("inf")
            for _ in range(args.repeats):
                began = time.perf_counter()
                prefill_batched(span, prompts, [GrowingCache() for _ in prompts], 0, blocks)
                together = min(together, time.perf_counter() - began)
                began = time.perf_counter()
                for prompt in prompts:
                    span(prompt, cache=GrowingCache())
                alone = min(alone, time.perf_counter() - began)
            sizes = sorted({p.shape[1] for p in prompts})
            label = f"{sizes[0]}-{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])
            print(f"{label:>14}{count:>10}{together * 1000:>10.1f}{alone * 1000:>12.1f}{together / alone:>8.2f}")


if __name__ == "__main__":
    main()
