"""A KV cache for decoding: each layer appends a token in place instead of copying its whole history.

Hugging Face's DynamicLayer concatenates the history with the new token at every step, so one decode step copies
every cached key and value of every layer: at 1500 cached tokens that is most of a CPU decode step's memory traffic
beyond the weights. A GrowingLayer keeps its keys/values as the first `length` positions of buffers with room to
spare; appending writes only the new positions. Its keys/values are ordinary tensors (views) to every reader, and
whatever replaces them (a crop, a beam reorder) is taken over at the next update.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# a buffer grows to what is needed plus this share of it (and at least GROW_MIN_TOKENS), within the session's maximum
GROW_SHARE = 0.25
GROW_MIN_TOKENS = 64


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views of buffers that hold at most `max_tokens` positions."""

    def __init__(self, max_tokens: int | None = None):
        super().__init__()
        self.max_tokens = max_tokens
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        needed = length + key_states.shape[-2]
        if not self._holds(key_states, value_states, length, needed):
            capacity = needed + max(GROW_MIN_TOKENS, int(needed * GROW_SHARE))
            if self.max_tokens is not None:
                capacity = max(needed, min(capacity, self.max_tokens))
            shape = (*key_states.shape[:2], capacity)
            keys = key_states.new_empty((*shape, key_states.shape[-1]))
            values = value_states.new_empty((*shape, value_states.shape[-1]))
            if length and self.keys is not None and self.values is not None:
                keys[..., :length, :] = self.keys
                values[..., :length, :] = self.values
            self._buffers = (keys, values)
        keys, values = self._buffers  # type: ignore[misc]  # _holds or the lines above set them
        keys[..., length:needed, :] = key_states
        values[..., length:needed, :] = value_states
        self.keys, self.values = keys[..., :needed, :], values[..., :needed, :]
        return self.keys, self.values

    def _holds(self, key_states: torch.Tensor, value_states: torch.Tensor, length: int, needed: int) -> bool:
        """Whether the buffers still back the layer's first `length` positions and have room for `needed`."""
        if self._buffers is None:
            return False
        pairs = zip(self._buffers, (key_states, value_states), (self.keys, self.values), strict=True)
        for buffer, new, current in pairs:
            if needed > buffer.shape[-2] or buffer.shape[:2] != new.shape[:2] or buffer.shape[-1] != new.shape[-1]:
                return False
            if buffer.dtype != new.dtype or buffer.device != new.device:
                return False
            if length and (
                current is None or current.data_ptr() != buffer.data_ptr() or current.stride() != buffer.stride()
            ):
                return False  # replaced (a beam reorder, a batch selection): its values are taken over
        return True

    def reset(self) -> None:
        self._buffers = None
        super().reset()


class GrowingCache(DynamicCache):
    """A DynamicCache of GrowingLayers, for a session that holds at most `max_tokens` positions per layer."""

    def __init__(self, max_tokens: int | None = None):
        super().__init__()
        self.layer_class_to_replicate = lambda: GrowingLayer(max_tokens)  # type: ignore[assignment]
