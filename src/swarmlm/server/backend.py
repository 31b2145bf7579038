"""The one owner of a server's weights: every computation on the span runs on its single compute thread."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from swarmlm.models.span import SpanModel
from swarmlm.server.validation import ForwardInputs, SpanLimits


class SpanBackend:
    """Runs requests on a span one at a time, in arrival order, off the event loop."""

    def __init__(self, span: SpanModel, dtype: torch.dtype, device: str, max_tokens: int):
        self.span, self.dtype, self.device = span, dtype, device
        config = span.config
        self.limits = SpanLimits(
            start=span.start,
            end=span.end,
            hidden_size=config.hidden_size,
            max_tokens=max_tokens,
            max_position=config.max_position_embeddings,
        )
        # a single worker thread is the queue: weights are never used by two computations at once
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="span-compute")

    async def forward(self, start: int, end: int, inputs: ForwardInputs) -> tuple[torch.Tensor, float]:
        """Hidden states after blocks [start, end), in the sender's dtype, and the compute time in ms."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._forward_sync, start, end, inputs)

    def _forward_sync(self, start: int, end: int, inputs: ForwardInputs) -> tuple[torch.Tensor, float]:
        began = time.perf_counter()
        with torch.inference_mode():
            hidden = inputs.hidden.to(self.device, self.dtype)
            mask = None if inputs.attention_mask is None else inputs.attention_mask.to(self.device)
            positions = None if inputs.position_ids is None else inputs.position_ids.to(self.device)
            out = self.span(hidden, start=start, end=end, attention_mask=mask, position_ids=positions)
            out = out.to("cpu", inputs.hidden.dtype)
        return out, (time.perf_counter() - began) * 1000

    def measure_throughput(self, tokens: int = 32, repeats: int = 3) -> float:
        """Tokens per second through one block, measured on random inputs at start-up."""
        hidden = torch.randn(1, tokens, self.limits.hidden_size)
        inputs = ForwardInputs(hidden, None, None)
        self._forward_sync(self.span.start, self.span.end, inputs)  # warm-up: first calls allocate
        elapsed = min(self._forward_sync(self.span.start, self.span.end, inputs)[1] for _ in range(repeats)) / 1000
        return tokens * (self.span.end - self.span.start) / max(elapsed, 1e-9)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
