"""The server's KV-cache budget: sessions reserve batch * max_length tokens at each block they use, and wait briefly
when it is full."""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import psutil
import torch
from transformers import PretrainedConfig

from swarmlm.errors import SwarmError

logger = logging.getLogger(__name__)

# share of the memory available at start-up that the default budget may fill with KV caches
DEFAULT_MEMORY_FRACTION = 0.25


class ServerBusyError(SwarmError):
    """The cache budget has no room for a session, even after waiting."""

    error_kind = "busy"


class CacheTooSmallError(ServerBusyError):
    """A session larger than this server's whole cache: another server may accept it."""

    error_kind = "too_large"


def bytes_per_token(config: PretrainedConfig, num_blocks: int, dtype: torch.dtype) -> int:
    """KV-cache bytes one token costs across num_blocks blocks (keys and values)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * num_blocks * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def default_cache_tokens(
    config: PretrainedConfig, num_blocks: int, dtype: torch.dtype, device: str = "cpu", reserved_bytes: int = 0
) -> int:
    """Tokens of a share of the memory free at start-up (the device's on CUDA), less `reserved_bytes` kept for the
    requests peers may buffer (so the cache budget and the buffers together stay within that share)."""
    if torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info(torch.device(device))[0]
    else:
        free = psutil.virtual_memory().available
    available = max(0, free * DEFAULT_MEMORY_FRACTION - reserved_bytes)
    return max(config.max_position_embeddings, int(available // bytes_per_token(config, num_blocks, dtype)))


class CacheBudget:
    """Counts reserved block-tokens (one token's keys and values at one block) against a fixed capacity, first come
    first served; lives on the server's event loop."""

    def __init__(self, capacity_tokens: int):
        self.capacity = capacity_tokens
        self.used = 0
        self._waiting: deque[tuple[int, asyncio.Future]] = deque()  # (tokens, granted) in arrival order

    @property
    def waiting(self) -> bool:
        """Whether sessions wait in line for room (a new one must not overtake them)."""
        return bool(self._waiting)

    def take(self, tokens: int) -> None:
        """Reserve `tokens` at once; the caller checked the room (server/admission.py) and that none waits."""
        if self._waiting or self.used + tokens > self.capacity:
            raise ServerBusyError(self._busy(tokens, "did not wait"))
        self.used += tokens

    async def reserve(self, tokens: int, timeout_s: float) -> None:
        """Reserve `tokens` after every earlier request, waiting up to timeout_s (0: not at all) for room to free up.

        ServerBusyError if there is no room in time; a waiting large request is never overtaken by a later small one.
        """
        if tokens > self.capacity:
            raise CacheTooSmallError(
                f"a session of {tokens} block-tokens exceeds this server's cache of {self.capacity} block-tokens"
            )
        if not self._waiting and self.used + tokens <= self.capacity:
            self.used += tokens
            return
        if timeout_s <= 0:
            raise ServerBusyError(self._busy(tokens, "did not wait (--alloc-timeout 0)"))
        granted = asyncio.get_running_loop().create_future()
        self._waiting.append((tokens, granted))
        try:
            await asyncio.wait_for(asyncio.shield(granted), timeout_s)
        except BaseException as e:
            if granted.done() and not granted.cancelled():
                self.release(tokens)  # granted just as the wait ended: give the room back to the next in line
            else:
                granted.cancel()
                self._grant()  # the head of the line left: those behind it may fit now
            if isinstance(e, TimeoutError):
                raise ServerBusyError(self._busy(tokens, f"waited {timeout_s:.1f} s")) from e
            raise

    def release(self, tokens: int) -> None:
        self.used -= tokens
        self._grant()

    def _grant(self) -> None:
        while self._waiting:
            tokens, granted = self._waiting[0]
            if granted.cancelled():
                self._waiting.popleft()
            elif self.used + tokens <= self.capacity:
                self._waiting.popleft()
                self.used += tokens
                granted.set_result(None)
            else:
                return

    def _busy(self, tokens: int, waited: str) -> str:
        return f"server busy: {self.used} of {self.capacity} cache block-tokens in use, {tokens} asked; {waited}"
