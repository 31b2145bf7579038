"""The servers' KV cache appends a token in place, and reads, crops and reorders exactly like Hugging Face's."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from swarmlm.models.growing_cache import GrowingCache


def _same(a: DynamicCache, b: DynamicCache, layers: tuple[int, ...]) -> None:
    for layer in layers:
        assert a.get_seq_length(layer) == b.get_seq_length(layer)
        assert torch.equal(a.layers[layer].keys, b.layers[layer].keys)
        assert torch.equal(a.layers[layer].values, b.layers[layer].values)


def test_growing_cache_equals_dynamic_cache_through_steps_crops_and_reorders() -> None:
    torch.manual_seed(0)
    usual, growing = DynamicCache(), GrowingCache(max_tokens=400)
    layers = (1, 3)  # a span's layers keep their global indices: earlier ones stay empty
    with torch.inference_mode():
        for step in range(150):
            new = 9 if step in (0, 60) else 1  # a prompt, later a chunk of several tokens
            keys, values = torch.randn(2, 3, new, 8), torch.randn(2, 3, new, 8)
            for layer in layers:
                expected = usual.update(keys, values, layer)
                got = growing.update(keys, values, layer)
                assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
            if step == 40:  # a rollback: the next tokens overwrite what was dropped
                usual.crop(-6)
                growing.crop(-6)
            if step == 90:  # beam search swaps rows: the reordered copy is taken over
                order = torch.tensor([1, 1])
                usual.reorder_cache(order)
                growing.reorder_cache(order)
            _same(usual, growing, layers)
        assert growing.get_seq_length(0) == 0


def test_appending_writes_in_place_and_buffers_stay_within_the_sessions_maximum() -> None:
    growing = GrowingCache(max_tokens=100)
    with torch.inference_mode():
        growing.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), 0)
        buffer = growing.layers[0].keys.data_ptr()
        grown = 0
        for _ in range(90):
            growing.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), 0)
            if growing.layers[0].keys.data_ptr() != buffer:
                grown, buffer = grown + 1, growing.layers[0].keys.data_ptr()
            capacity = growing.layers[0]._buffers[0].shape[-2]
            assert growing.get_seq_length(0) <= capacity <= 100
        assert growing.get_seq_length(0) == 100
        assert grown <= 2  # 10 tokens -> room for 74, then the session's 100: not a copy per token
