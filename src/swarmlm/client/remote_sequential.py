"""RemoteSequential: the decoder blocks of a model, served by the swarm, as one nn.Module."""

from __future__ import annotations

import asyncio
import logging

import torch
from torch import nn

from swarmlm.client.chain import ForwardArgs, run_forward_chain
from swarmlm.client.loop import LoopThread
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.config import ClientConfig
from swarmlm.errors import SessionClosedError

logger = logging.getLogger(__name__)


class SwarmClient:
    """What all RemoteSequential slices of one model share: the event loop thread and the view of the swarm."""

    def __init__(self, config: ClientConfig, dht_prefix: str, num_blocks: int):
        self.config = config
        self.loop = LoopThread()
        self.manager = SequenceManager(config, dht_prefix, num_blocks)
        try:
            self.loop.run(self.manager.start())
        except BaseException:
            self.loop.close()
            raise
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.loop.run(self.manager.close(), timeout=30)
            finally:
                self.loop.close()


def split_batch(batch: int, seq: int, max_tokens: int) -> list[tuple[int, int]]:
    """(begin, end) row ranges of sub-batches holding at most max_tokens tokens (at least one row each)."""
    rows = max(1, max_tokens // max(seq, 1))
    return [(i, min(i + rows, batch)) for i in range(0, batch, rows)]


class RemoteSequential(nn.Module):
    """Blocks [start, end) of a model; calling it runs them through the swarm, with failover."""

    def __init__(self, client: SwarmClient, start: int = 0, end: int | None = None):
        super().__init__()
        self.client = client
        self.start = start
        self.end = client.manager.num_blocks if end is None else end
        if not 0 <= self.start < self.end <= client.manager.num_blocks:
            raise ValueError(f"blocks {self.start}:{self.end} are outside 0:{client.manager.num_blocks}")

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, index: int | slice) -> RemoteSequential:
        if isinstance(index, int):
            if not -len(self) <= index < len(self):
                raise IndexError(f"block {index} out of range for {len(self)} blocks")
            index = slice(index % len(self), index % len(self) + 1)
        first, last, step = index.indices(len(self))
        if step != 1 or first >= last:
            raise IndexError("RemoteSequential slices must be contiguous and non-empty")
        return RemoteSequential(self.client, self.start + first, self.start + last)

    def extra_repr(self) -> str:
        return f"blocks={self.start}:{self.end}"

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden (batch, seq, hidden) -> hidden after the blocks; big batches run as concurrent sub-batches."""
        if self.client.closed:
            raise SessionClosedError("this model's swarm connection is closed")
        if hidden.ndim != 3:
            raise ValueError(f"hidden states must be (batch, seq, hidden), got {tuple(hidden.shape)}")
        for name, extra in (("attention_mask", attention_mask), ("position_ids", position_ids)):
            if extra is not None and tuple(extra.shape) != tuple(hidden.shape[:2]):
                raise ValueError(f"{name} must have shape {tuple(hidden.shape[:2])}, got {tuple(extra.shape)}")
        return self.client.loop.run(self._forward(hidden.detach().cpu(), attention_mask, position_ids))

    async def _forward(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None
    ) -> torch.Tensor:
        pieces = split_batch(hidden.shape[0], hidden.shape[1], self.client.config.max_tokens_per_request)
        manager = self.client.manager
        tasks = []
        for begin, end in pieces:
            args = ForwardArgs(
                None if mask is None else mask[begin:end], None if positions is None else positions[begin:end]
            )
            tasks.append(run_forward_chain(manager, hidden[begin:end], self.start, self.end, args))
        results = await asyncio.gather(*tasks)
        return torch.cat([out for out, _ in results], dim=0)
