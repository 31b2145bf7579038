"""Decode steps of several sessions run as one forward give each session exactly what it gets alone."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from swarmlm.models.batched import decode_batched
from swarmlm.models.span import SpanModel


def test_batched_decode_equals_each_session_alone(tiny_model_dir: Path) -> None:
    torch.manual_seed(1)
    span = SpanModel.from_dir(tiny_model_dir, 1, 4)
    start, end = 2, 4  # a sub-range that does not begin at block 0: caches are addressed by global layer index
    lengths, rows = [5, 0, 12, 1, 7], [1, 1, 2, 1, 1]
    alone, batched = [], []
    with torch.inference_mode():
        for length, row in zip(lengths, rows, strict=True):
            prefix = torch.randn(row, length, 64)
            caches = [DynamicCache(), DynamicCache()]
            for cache in caches:
                if length:
                    span(prefix, start=start, end=end, cache=cache)
            alone.append(caches[0])
            batched.append(caches[1])
        for _ in range(3):  # several steps: the caches each session keeps go on growing correctly
            tokens = [torch.randn(row, 1, 64) for row in rows]
            expected = [span(t, start=start, end=end, cache=c) for t, c in zip(tokens, alone, strict=True)]
            got = decode_batched(span, tokens, batched, start, end)
            for e, g in zip(expected, got, strict=True):
                assert g.shape == e.shape
                assert (g - e).abs().max().item() <= 1e-5
            for a, b in zip(alone, batched, strict=True):
                assert a.get_seq_length(start) == b.get_seq_length(start)
                for layer in range(start, end):
                    assert (a.layers[layer].keys - b.layers[layer].keys).abs().max().item() <= 1e-5
