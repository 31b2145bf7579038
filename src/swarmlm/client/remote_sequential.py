"""RemoteSequential: the decoder blocks of a model, served by the swarm, as one nn.Module."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import torch
from torch import nn

from swarmlm.client import trace
from swarmlm.client.chain import ChainArgs, Hop, run_backward_chain, run_forward_chain
from swarmlm.client.inference import InferenceSession
from swarmlm.client.loop import LoopThread
from swarmlm.client.sequence_manager import SequenceManager
from swarmlm.client.span_call import RerouteError, fetch_info
from swarmlm.config import ClientConfig
from swarmlm.errors import ConfigError, SessionClosedError
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.protocol.lora import LoraWeights
from swarmlm.protocol.messages import ServerInfo

logger = logging.getLogger(__name__)

T = TypeVar("T")
# a sub-batch: its row range in the batch and what its chain carries
Piece = tuple[int, int, ChainArgs]


class SwarmConnection:
    """One process's link to a swarm: the client's event loop thread and its view of the swarm (DHT node, routing,
    health, spot checks). Models loaded with `client=` share one, so a process holds one DHT node, one loop and one
    view of the servers whatever the number of models (a chat model and a trainer, or several tuning modes). It is
    closed when the last model using it is closed."""

    def __init__(self, config: ClientConfig, dht_prefix: str, num_blocks: int, fingerprint: str | None = None):
        self.config, self.fingerprint = config, fingerprint
        self.loop = LoopThread()
        self.manager = SequenceManager(config, dht_prefix, num_blocks, fingerprint)
        try:
            self.loop.run(self.manager.start())
        except BaseException:
            self.loop.close()
            raise
        self._users = 1
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._users == 0

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                raise SessionClosedError("that model's swarm connection is closed: its models were all closed")
            self._users += 1

    def release(self) -> None:
        with self._lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users:
                return
        try:
            self.loop.run(self.manager.close(), timeout=30)
        finally:
            self.loop.close()


class SwarmClient:
    """What all RemoteSequential slices of one model share: a SwarmConnection (perhaps shared with other models of
    the same checkpoint) and this model's last trace."""

    def __init__(
        self,
        config: ClientConfig | None,
        dht_prefix: str | None,
        num_blocks: int,
        fingerprint: str | None = None,
        *,
        share: SwarmClient | None = None,
    ):
        """A new connection from config, dht_prefix and fingerprint; or, with `share`, the connection of another
        model's client, which must serve the same checkpoint (num_blocks and fingerprint)."""
        if share is None:
            if config is None or dht_prefix is None:
                raise ValueError("a new swarm connection needs a ClientConfig and a DHT prefix")
            self.connection = SwarmConnection(config, dht_prefix, num_blocks, fingerprint)
        else:
            theirs = share.connection
            if theirs.manager.num_blocks != num_blocks or theirs.fingerprint != fingerprint:
                raise ConfigError(
                    f"client= is connected to servers of another checkpoint ({theirs.manager.num_blocks} blocks, "
                    f"fingerprint {theirs.fingerprint}) than this model ({num_blocks} blocks, fingerprint "
                    f"{fingerprint}): only models loaded from the same checkpoint share a connection"
                )
            theirs.acquire()
            self.connection = theirs
        self.closed = False
        self.last_trace: trace.RequestTrace | None = None  # of the last forward, backward or inference step

    @property
    def config(self) -> ClientConfig:
        return self.connection.config

    @property
    def loop(self) -> LoopThread:
        return self.connection.loop

    @property
    def manager(self) -> SequenceManager:
        return self.connection.manager

    def keep_trace(self, finished: trace.RequestTrace) -> None:
        self.last_trace = finished

    def run_traced(self, kind: str, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a request on the client's loop, keeping its trace as last_trace."""
        return self.loop.run(trace.traced(kind, coroutine, self.keep_trace))

    def server_info(self, peer_id: str) -> ServerInfo:
        """What one server says about itself now: span, version, fingerprint, limits, free cache and speed."""
        return self.loop.run(fetch_info(self.manager, peer_id))

    def server_infos(self) -> dict[str, ServerInfo]:
        """server_info of every server this client would use now; servers that do not answer are left out."""

        async def ask_all() -> dict[str, ServerInfo]:
            peers = list(self.manager.servers)
            answers = await asyncio.gather(*(fetch_info(self.manager, p) for p in peers), return_exceptions=True)
            return {p: a for p, a in zip(peers, answers, strict=True) if isinstance(a, ServerInfo)}

        return self.loop.run(ask_all())

    def close(self) -> None:
        """This model is done with the swarm; the connection closes with the last model using it."""
        if not self.closed:
            self.closed = True
            self.connection.release()


def split_batch(batch: int, seq: int, max_tokens: int) -> list[tuple[int, int]]:
    """(begin, end) row ranges of sub-batches holding at most max_tokens tokens (at least one row each)."""
    rows = max(1, max_tokens // max(seq, 1))
    return [(i, min(i + rows, batch)) for i in range(0, batch, rows)]


async def gather_or_cancel(coroutines: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """The results of all coroutines, run concurrently; when one raises, the others are cancelled (their streams
    closed, their servers freed) and that error is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(coroutine) for coroutine in coroutines]
    except BaseExceptionGroup as errors:
        first: BaseException = errors
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None  # the group only wraps it: the caller sees the error itself
    return [task.result() for task in tasks]


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

    def inference_session(self, max_length: int, *, active: list[InferenceSession] | None = None) -> InferenceSession:
        """A session over this slice's blocks holding up to max_length tokens: `.step(hidden)` runs new tokens
        through the servers' KV caches. Use it as a context manager, or close() it."""
        if self.client.closed:
            raise SessionClosedError("this model's swarm connection is closed")
        client = self.client
        return InferenceSession(
            client.manager, client.loop, self.start, self.end, max_length, active, on_trace=client.keep_trace
        )

    def extra_repr(self) -> str:
        return f"blocks={self.start}:{self.end}"

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        prompts: torch.Tensor | None = None,
        lora: LoraWeights | None = None,
    ) -> torch.Tensor:
        """hidden (batch, seq, hidden) -> hidden after the blocks; big batches run as concurrent sub-batches.

        prompts (len(self), prefix, hidden), or per sample (len(self), batch, prefix, hidden): deep prompts,
        prompts[i] added to the first `prefix` positions of the input of this slice's block i. lora: the caller's
        own LoRA weights of exactly this slice's blocks, applied by the servers. Differentiable wrt hidden, prompts
        and lora.flat.
        """
        if self.client.closed:
            raise SessionClosedError("this model's swarm connection is closed")
        if hidden.ndim != 3:
            raise ValueError(f"hidden states must be (batch, seq, hidden), got {tuple(hidden.shape)}")
        for name, extra in (("attention_mask", attention_mask), ("position_ids", position_ids)):
            if extra is not None and tuple(extra.shape) != tuple(hidden.shape[:2]):
                raise ValueError(f"{name} must have shape {tuple(hidden.shape[:2])}, got {tuple(extra.shape)}")
        if prompts is not None and (
            prompts.ndim not in (3, 4) or prompts.shape[0] != len(self) or prompts.shape[-1] != hidden.shape[-1]
            or (prompts.ndim == 4 and prompts.shape[1] != hidden.shape[0])
        ):  # fmt: skip
            raise ValueError(
                f"prompts must be ({len(self)}, prefix, hidden) or ({len(self)}, batch, prefix, hidden), "
                f"got {tuple(prompts.shape)}"
            )
        if lora is not None and (lora.first, lora.end) != (self.start, self.end):
            raise ValueError(f"lora holds blocks {lora.first}:{lora.end}, not this slice's {self.start}:{self.end}")
        flat = None if lora is None else lora.flat
        # a backward will follow: the servers keep their forward's graphs for it
        keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, prompts, flat))
        return _RemoteBlocks.apply(hidden, prompts, flat, self, attention_mask, position_ids, lora, keep)

    def _pieces(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        prompts: torch.Tensor | None,
        lora: LoraWeights | None = None,
    ) -> list[Piece]:
        """The sub-batches (row ranges) of a batch and the arguments each one's chain carries: at most the client's
        max_tokens_per_request tokens each, and no more than the servers of every block announce they accept."""
        max_tokens = self.client.manager.request_limit(self.start, self.end)
        inputs = SpanTensors(hidden, attention_mask=mask, position_ids=positions, prompts=prompts)
        return [
            (begin, end, ChainArgs(inputs.select_rows(begin, end), prompts_start=self.start, lora=lora))
            for begin, end in split_batch(hidden.shape[0], hidden.shape[1], max_tokens)
        ]

    async def _forward(
        self, pieces: list[Piece], keep: bool = False
    ) -> tuple[torch.Tensor, list[Piece], list[list[Hop]]]:
        """The output of all sub-batches, and the sub-batches as they ran (split further where servers refused
        them as too large) with each one's hops; keep: the servers keep their graphs for the backward."""
        results = await gather_or_cancel(self._forward_piece(piece, keep) for piece in pieces)
        done = [result for piece_results in results for result in piece_results]
        output = torch.cat([out for _, out, _ in done], dim=0)
        return output, [piece for piece, _, _ in done], [hops for _, _, hops in done]

    async def _forward_piece(self, piece: Piece, keep: bool) -> list[tuple[Piece, torch.Tensor, list[Hop]]]:
        begin, end, args = piece
        try:
            out, hops = await run_forward_chain(
                self.client.manager, args.inputs.hidden, self.start, self.end, args, keep=keep
            )
        except RerouteError as e:
            if e.kind != "too_large" or end - begin < 2:
                raise
            # no server takes this many tokens for some span: halve the sub-batch
            middle = (end - begin) // 2
            logger.info("Splitting a sub-batch of %d rows that no server accepts: %s", end - begin, e)
            halves = [
                (begin, begin + middle, replace(args, inputs=args.inputs.select_rows(0, middle))),
                (begin + middle, end, replace(args, inputs=args.inputs.select_rows(middle, end - begin))),
            ]
            results = await gather_or_cancel(self._forward_piece(half, keep) for half in halves)
            return [result for half_results in results for result in half_results]
        return [(piece, out, hops)]

    async def _backward(
        self, grad: torch.Tensor, pieces: Sequence[Piece], hops: list[list[Hop]]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Gradients wrt hidden, prompts and LoRA weights, summed over the sub-batches where they are shared."""
        manager = self.client.manager
        results = await gather_or_cancel(
            run_backward_chain(manager, piece_hops, grad[begin:end], args)
            for (begin, end, args), piece_hops in zip(pieces, hops, strict=True)
        )
        grad_hidden = torch.cat([g for g, _, _ in results], dim=0)
        grad_loras = [g for _, _, g in results if g is not None]
        grad_lora = torch.stack(grad_loras).sum(0) if grad_loras else None
        grad_prompts = [g for _, g, _ in results if g is not None]
        if not grad_prompts:
            return grad_hidden, None, grad_lora
        if grad_prompts[0].ndim == 4:  # per-sample prompts: each sub-batch has its own rows
            return grad_hidden, torch.cat(grad_prompts, dim=1), grad_lora
        return grad_hidden, torch.stack(grad_prompts).sum(0), grad_lora


class _RemoteBlocks(torch.autograd.Function):
    """Autograd through remote blocks: forward remembers each sub-batch's hops, backward walks them in reverse."""

    @staticmethod
    def forward(
        ctx: Any,  # autograd's context: forward stores what backward needs as its attributes
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
        lora_flat: torch.Tensor | None,  # lora.flat, an argument of its own so that autograd gives its gradient
        blocks: RemoteSequential,
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        lora: LoraWeights | None,
        keep: bool,  # the servers keep their graphs for the backward
    ) -> torch.Tensor:
        send_prompts = None if prompts is None else prompts.detach().cpu()
        send_lora = None if lora is None or lora_flat is None else lora.with_flat(lora_flat.detach().cpu())
        pieces = blocks._pieces(hidden.detach().cpu(), mask, positions, send_prompts, send_lora)
        output, pieces, hops = blocks.client.run_traced("forward", blocks._forward(pieces, keep))
        ctx.blocks, ctx.pieces, ctx.hops = blocks, pieces, hops
        ctx.hidden_meta = (hidden.dtype, hidden.device)
        ctx.prompts_meta = None if prompts is None else (prompts.dtype, prompts.device)
        ctx.lora_meta = None if lora_flat is None else (lora_flat.dtype, lora_flat.device)
        return output.to(hidden.device, hidden.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        blocks: RemoteSequential = ctx.blocks
        grad_hidden, grad_prompts, grad_lora = blocks.client.run_traced(
            "backward", blocks._backward(grad_output.detach().cpu().float(), ctx.pieces, ctx.hops)
        )
        grad_hidden = grad_hidden.to(ctx.hidden_meta[1], ctx.hidden_meta[0])
        if grad_prompts is not None:
            grad_prompts = grad_prompts.to(ctx.prompts_meta[1], ctx.prompts_meta[0])
        if grad_lora is not None:
            grad_lora = grad_lora.to(ctx.lora_meta[1], ctx.lora_meta[0])
        return grad_hidden, grad_prompts, grad_lora, None, None, None, None, None
