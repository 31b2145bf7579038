"""The server's KV-cache budget: sessions reserve batch * max_length tokens and wait briefly when it is full."""

from __future__ import annotations

import asyncio
import logging

import psutil
import torch
from transformers import PretrainedConfig

from swarmlm.errors import SwarmError

logger = logging.getLogger(__name__)

# share of the memory available at start-up that the default budget may fill with KV caches
DEFAULT_MEMORY_FRACTION = 0.25


class ServerBusyError(SwarmError):
    """The cache budget has no room for a session, even after waiting."""


def bytes_per_token(config: PretrainedConfig, num_blocks: int, dtype: torch.dtype) -> int:
    """KV-cache bytes one token costs across num_blocks blocks (keys and values)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * num_blocks * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def default_cache_tokens(config: PretrainedConfig, num_blocks: int, dtype: torch.dtype) -> int:
    available = psutil.virtual_memory().available * DEFAULT_MEMORY_FRACTION
    return max(config.max_position_embeddings, int(available // bytes_per_token(config, num_blocks, dtype)))


class CacheBudget:
    """Counts reserved tokens against a fixed capacity; lives on the server's event loop."""

    def __init__(self, capacity_tokens: int):
        self.capacity = capacity_tokens
        self.used = 0
        self._changed = asyncio.Condition()

    async def reserve(self, tokens: int, timeout_s: float) -> None:
        """Reserve `tokens`, waiting up to timeout_s for other sessions to free room; ServerBusyError if none."""
        if tokens > self.capacity:
            raise ServerBusyError(
                f"a session of {tokens} tokens exceeds this server's cache of {self.capacity} tokens"
            )
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.used + tokens <= self.capacity), timeout_s)
            except TimeoutError as e:
                raise ServerBusyError(
                    f"server busy: {self.used} of {self.capacity} cache tokens in use, {tokens} asked; "
                    f"waited {timeout_s:.1f} s"
                ) from e
            self.used += tokens

    async def release(self, tokens: int) -> None:
        async with self._changed:
            self.used -= tokens
            self._changed.notify_all()
