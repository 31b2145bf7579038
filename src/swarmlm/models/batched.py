"""One-token decode steps of several sessions, each with its own KV cache, run through a span as one forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from swarmlm.models.registry import SLIDING_ATTENTION
from swarmlm.models.span import SpanModel


class StackedCaches:
    """The `cache=` of a batched decode step: each layer's update goes to every session's own cache, and the layer
    attends over their keys/values left-padded to the longest session and stacked along the batch dimension."""

    def __init__(self, caches: Sequence[DynamicCache], rows: Sequence[int], lengths: Sequence[int]):
        self.caches, self.rows, self.lengths = list(caches), list(rows), list(lengths)
        self.longest = max(self.lengths)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value_states (rows, kv_heads, 1, head_dim) -> all keys/values (rows, kv_heads, longest + 1, dim)."""
        keys = key_states.new_empty(key_states.shape[:2] + (self.longest + 1, key_states.shape[-1]))
        values = value_states.new_empty(value_states.shape[:2] + (self.longest + 1, value_states.shape[-1]))
        row = 0
        for cache, rows, length in zip(self.caches, self.rows, self.lengths, strict=True):
            # the session's own cache takes its new token and returns its whole history (rows, kv, length + 1, d)
            k, v = cache.update(key_states[row : row + rows], value_states[row : row + rows], layer_idx)
            pad = self.longest - length  # left padding, masked out: the new token stays the last column
            keys[row : row + rows, :, pad:] = k
            values[row : row + rows, :, pad:] = v
            if pad:  # masked, but must be finite: a masked score is still computed from it
                keys[row : row + rows, :, :pad] = 0
                values[row : row + rows, :, :pad] = 0
            row += rows
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.longest

    @property
    def is_compileable(self) -> bool:  # asked by some attention paths; a dynamic, Python-level cache is not
        return False


def decode_batched(
    span: SpanModel, hidden: Sequence[torch.Tensor], caches: Sequence[DynamicCache], start: int, end: int,
    adapter: str | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """hidden[i] (rows_i, 1, hidden) is one new token of the session owning caches[i]; returns each session's output
    (rows_i, 1, hidden) after blocks [start, end), as if it had run alone, and appends its token to its own cache.
    All sessions use the same LoRA adapter (None: the base model)."""
    span.use_adapter(adapter)
    rows = [h.shape[0] for h in hidden]
    lengths = [cache.get_seq_length(start) for cache in caches]
    longest = max(lengths)
    states = torch.cat(list(hidden))  # (sum rows, 1, hidden)
    row_lengths = torch.tensor([n for n, r in zip(lengths, rows, strict=True) for _ in range(r)], device=states.device)
    # each row continues at its own position
    position_ids = row_lengths.unsqueeze(1)  # (sum rows, 1)
    # (sum rows, longest + 1): a row's first longest - length columns are padding
    columns = torch.arange(longest + 1, device=states.device)
    hidden_columns = columns.unsqueeze(0) < (longest - row_lengths).unsqueeze(1)
    kinds = span.layer_kinds[start:end]
    masks, rotaries = {}, {}
    for kind in dict.fromkeys(kinds):
        masked = hidden_columns
        if kind == SLIDING_ATTENTION:
            # the new token sees only the last `window` positions, itself included; every row's new token sits in
            # the last column, so the window is the same columns for all rows
            masked = masked | (columns < longest + 1 - span.config.sliding_window).unsqueeze(0)
        mask = torch.zeros(masked.shape, dtype=states.dtype, device=states.device)
        masks[kind] = mask.masked_fill(masked, torch.finfo(states.dtype).min)[:, None, None, :]
        rotaries[kind] = span.family.position_embeddings(span.rotary, states, position_ids, kind)
    stacked = StackedCaches(caches, rows, lengths)
    for layer, kind in zip(span.layers[start - span.start : end - span.start], kinds, strict=True):
        states = layer(
            states,
            attention_mask=masks[kind],
            position_ids=position_ids,
            cache=stacked,
            use_cache=True,
            position_embeddings=rotaries[kind],
        )
    return list(torch.split(states, rows))
