"""The one owner of a server's weights: every computation on the span runs on its single compute thread."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
from transformers.cache_utils import DynamicCache

from swarmlm.models.batched import decode_batched, prefill_batched
from swarmlm.models.growing_cache import GrowingCache
from swarmlm.models.lora import linear_shapes
from swarmlm.models.registry import SLIDING_ATTENTION
from swarmlm.models.span import SpanModel
from swarmlm.protocol.bundle import ReplyTensors, SpanTensors
from swarmlm.protocol.lora import LoraWeights
from swarmlm.server.activations import ActivationCache
from swarmlm.server.joining import JoinableRequest, join, split
from swarmlm.server.pieces import (
    PIECE_BYTES,
    RECOMPUTE_GRAPH_BYTES,
    BlockGraph,
    SpanCall,
    Spent,
    backward_block,
    backward_rows,
    forward_block,
    forward_block_graph,
    piece_tokens,
)
from swarmlm.server.scheduler import BatchLimits, DecodeStep, Kind, Scheduler
from swarmlm.server.speed import median_rate
from swarmlm.server.validation import SpanLimits

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Keeping:
    """A forward's graph to keep for its backward, or a backward's kept graph to run from (server/activations.py):
    the sender, its host and the id it chose."""

    peer: str
    host: str
    key: str


@dataclass(frozen=True)
class SpanWork:
    """A forward over blocks [start, end), or a backward when inputs carry grad_outputs: the work item the scheduler
    holds for it (SpanBackend.execute runs it). adapter: the LoRA adapter to apply (None: the base model); lora: the
    request's own LoRA weights; keeping: a forward's graph to keep, or the kept graph a backward may run from;
    owned: the forward may compute in inputs.hidden's memory (its sender reads it no more: a request off the wire)."""

    start: int
    end: int
    inputs: SpanTensors
    adapter: str | None = None
    lora: LoraWeights | None = None
    keeping: Keeping | None = None
    owned: bool = False


@dataclass(frozen=True)
class StepWork:
    """An inference step of the session owning `cache` over blocks [start, end): the work item the scheduler holds
    for it (SpanBackend.execute runs it). It runs in chunks of at most chunk_tokens; with start_from the cache is
    first cut back to that many tokens; long: it runs in pieces of the scheduler's quanta (scheduling.Kind.PROMPT)."""

    cache: DynamicCache
    start: int
    end: int
    inputs: SpanTensors
    chunk_tokens: int
    start_from: int | None = None
    adapter: str | None = None
    lora: LoraWeights | None = None
    long: bool = False


# what a computation in pieces is sent before each piece (its size in tokens; 0 or None: its own) and returns
Pieces = Generator[None, int | None, tuple[ReplyTensors, float]]


class SpanBackend:
    """Runs requests on a span off the event loop, in the scheduler's order: one at a time, except one-token
    decode steps of several sessions, which may run as one forward."""

    def __init__(
        self, span: SpanModel, dtype: torch.dtype, device: str, max_tokens: int,
        batch_limits: BatchLimits | None = None, activations: ActivationCache | None = None,
    ):  # fmt: skip
        self.span, self.dtype, self.device = span, dtype, device
        # the graphs of forwards kept for their backwards; only the compute thread uses it
        self.activations = ActivationCache(0) if activations is None else activations
        # bytes a block's graph held per token, as last measured (before any: none, so a first forward may keep)
        self._graph_bytes_per_token = 0.0
        config = span.config
        # the most tokens a forward's piece runs at once: its activations stay bounded (server/pieces.py)
        self._piece_tokens = piece_tokens(config, dtype)
        self._recompute_graph_bytes = RECOMPUTE_GRAPH_BYTES
        self.limits = SpanLimits(
            start=span.start,
            end=span.end,
            hidden_size=config.hidden_size,
            max_tokens=max_tokens,
            max_position=config.max_position_embeddings,
            adapters=span.adapters,
            linear_shapes=tuple(linear_shapes(layer) for layer in span.layers),
        )
        # a single worker thread is the queue: weights are never used by two computations at once
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="span-compute")
        limits = batch_limits or BatchLimits()
        self.scheduler = Scheduler(
            self._executor, self.execute, self._decode_batch, limits, run_joined=self._run_joined
        )

    async def run(
        self, start: int, end: int, inputs: SpanTensors, peer: str = "", adapter: str | None = None,
        lora: LoraWeights | None = None, keeping: Keeping | None = None, host: str = "", owned: bool = False,
    ) -> tuple[ReplyTensors, float]:  # fmt: skip
        """Forward: the reply's hidden states after blocks [start, end); backward (inputs.grad_outputs given): its
        grad_hidden, and grad_prompts / grad_lora when the request sent prompts / LoRA weights. Tensors come back in
        the sender's dtypes, with the compute time in ms. adapter: the LoRA adapter to apply (None: the base
        model); lora: the request's own LoRA weights (validated: server.validation.check_lora); keeping: a forward's
        graph to keep, or the kept graph a backward may run from; owned: the caller reads inputs.hidden no more, so a
        forward may compute in its memory (else in a copy)."""
        kind = Kind.FORWARD if inputs.grad_outputs is None else Kind.BACKWARD
        # a block at a time: the scheduler runs waiting inference steps between blocks of a long request
        # requests of other peers over the same blocks and of the same shape may run joined with this one
        # (only without an adapter or own LoRA weights: those never share a computation). A forward that asks to
        # keep its graph keeps it only when it runs alone; a backward runs alone only from a graph still kept here
        if keeping is not None and kind is Kind.BACKWARD and not self.activations.holds(keeping.peer, keeping.key):
            keeping = None  # its forward ran joined, or the graph is gone: recomputed, so it may join others
        from_graph = keeping is not None and kind is Kind.BACKWARD
        alone = inputs.hypo_ids is not None or adapter is not None or lora is not None or from_graph
        joinable = None if alone else JoinableRequest(start, end, inputs, peer)
        work = SpanWork(start, end, inputs, adapter, lora, keeping, owned)
        builds_graphs = kind is Kind.BACKWARD or keeping is not None  # it builds autograd graphs (or runs from them)
        result: tuple[ReplyTensors, float] = await self.scheduler.submit(
            kind, peer, work, join=joinable, host=host, exclusive=builds_graphs
        )
        return result

    def execute(self, work: SpanWork | StepWork) -> Pieces:
        """Run a work item on the compute thread, in the pieces the scheduler sends sizes for (a short step is one
        piece): its reply, named, and the compute time in ms."""
        if isinstance(work, SpanWork):
            results, compute_ms = yield from self._run_by_block(
                work.start, work.end, work.inputs, work.adapter, work.lora, work.keeping, work.owned
            )
            return _named(work.inputs, results), compute_ms
        (hidden,), compute_ms = yield from self._step(
            work.cache, work.start, work.end, work.inputs, work.chunk_tokens, work.start_from, work.adapter, work.lora,
            work.long,
        )  # fmt: skip
        return ReplyTensors(hidden=hidden), compute_ms

    async def expire_kept(self) -> int:
        """Free the kept graphs whose backward did not come in time (on the compute thread, which alone changes the
        cache); how many were dropped."""
        dropped: int = await asyncio.get_running_loop().run_in_executor(self._executor, self.activations.expire)
        return dropped

    def _run_joined(
        self, requests: list[JoinableRequest]
    ) -> Generator[None, int | None, list[tuple[ReplyTensors, float]]]:
        """Requests joined along the batch dimension as one computation, a block at a time; each gets its own
        reply (and the shared compute time)."""
        start, end = requests[0].start, requests[0].end
        results, compute_ms = yield from self._run_by_block(start, end, join(requests), None, owned=True)
        kind = "backward" if requests[0].inputs.grad_outputs is not None else "forward"
        peers, tokens = len({r.peer for r in requests}), sum(r.tokens for r in requests)
        logger.debug("%s batch requests=%d peers=%d blocks=%d:%d tokens=%d %.1f ms", kind, len(requests), peers,
                    start, end, tokens, compute_ms)  # fmt: skip
        replies = [_named(r.inputs, outputs) for r, outputs in zip(requests, split(results, requests), strict=True)]
        return [(reply, compute_ms) for reply in replies]

    def _run(self, start: int, end: int, inputs: SpanTensors) -> tuple[list[torch.Tensor], float]:
        """_run_by_block in one go, without adapter."""
        return whole(self._run_by_block(start, end, inputs, None))

    def _run_by_block(
        self,
        start: int,
        end: int,
        inputs: SpanTensors,
        adapter: str | None,
        lora: LoraWeights | None = None,
        keeping: Keeping | None = None,
        owned: bool = False,
    ) -> Generator[None, int | None, tuple[list[torch.Tensor], float]]:
        """The one computation of a span, in pieces (server.pieces: a block, or a chunk of a block's tokens, at a
        time, of the sizes the scheduler sends): its forward, then, when grad_outputs are given, the backward block
        by block in reverse (each block's graph is cut from the next one's, so a block's input gradient is exactly
        what autograd through the whole span gives). Returns the results in the sender's dtypes and the compute
        time in ms. No grad mode is held across a yield: other work runs in between, and the request's own LoRA
        weights are hooked into a block only while it runs (models/lora.py).

        With keeping, a forward keeps its graphs in the activation cache, and a backward runs from the graphs its
        forward kept when they are still there and of exactly these inputs (else it recomputes the forward).

        A forward without a graph computes in place (server.pieces.forward_block): in inputs.hidden's own memory when
        `owned` and it is already of the server's device and dtype (it holds the output afterwards), else in a copy.
        A request off the wire then holds one copy of its hidden states while it runs, the size it was charged on
        arrival, not its input, its output and the output's pieces."""
        backward = inputs.grad_outputs is not None
        spent = Spent()
        mask = None if inputs.attention_mask is None else inputs.attention_mask.to(self.device)
        positions = None if inputs.position_ids is None else inputs.position_ids.to(self.device)
        call = SpanCall(self.span, mask, positions, adapter, self._piece_tokens)
        hidden = inputs.hidden.detach().to(self.device, self.dtype)
        prompts = None if inputs.prompts is None else inputs.prompts.to(self.device, self.dtype)
        lora = None if lora is None else lora.with_flat(lora.flat.to(self.device))
        cache, forward_inputs = self.activations, replace(inputs, grad_outputs=None)
        tokens = hidden.shape[0] * hidden.shape[1]
        if keeping is not None and not backward and tokens * (end - start) * self._graph_bytes_per_token >= cache.cap:
            keeping = None  # its graph would not be kept (as the graphs so far measured): no need to build it
        shared = hidden.untyped_storage().data_ptr() == inputs.hidden.untyped_storage().data_ptr()
        if not backward and keeping is None and (not hidden.is_contiguous() or (shared and not owned)):
            hidden = hidden.clone(memory_format=torch.contiguous_format)  # the forward computes in this memory
        kept = None
        if backward and keeping is not None:
            kept = cache.take(keeping.peer, keeping.key, start, end, adapter, forward_inputs)
            how = "runs from its kept forward" if kept else "recomputes its forward (its graph is not kept here)"
            logger.debug("backward blocks=%d:%d peer=...%s %s; %d graphs kept, %.0f MB", start, end,
                        keeping.peer[-6:], how, len(cache), cache.nbytes / 1e6)  # fmt: skip
        graphs: list[BlockGraph] = kept or []
        graphs_bytes = 0  # what the graphs built so far hold
        # a recomputed backward whose graphs would exceed RECOMPUTE_GRAPH_BYTES keeps only each block's input, and
        # rebuilds each block's graph a group of rows at a time for its backward (server.pieces.backward_rows): the
        # graphs of a whole span hold ~16 times the request's size per block. A smaller one builds them all at once,
        # one forward less
        estimate = tokens * (end - start) * PIECE_BYTES / max(1, self._piece_tokens)
        checkpointed = backward and kept is None and estimate > self._recompute_graph_bytes
        block_inputs: list[torch.Tensor] = []  # a checkpointed backward's: each block's input
        for block in range(start, end) if kept is None else ():
            prompt = None if prompts is None else prompts[block - start : block - start + 1]
            block_lora = None if lora is None else lora.blocks(block, block + 1)
            if checkpointed:
                block_inputs.append(hidden)
                if block < end - 1:
                    hidden = hidden.clone()
                    yield from forward_block(call, block, hidden, prompt, block_lora, spent)
            elif backward or keeping is not None:
                hidden, graph = yield from forward_block_graph(call, block, hidden, prompt, block_lora, spent)
                graphs.append(graph)
                nbytes = graph.nbytes
                graphs_bytes += nbytes
                self._graph_bytes_per_token = nbytes / max(1, tokens)
                if not backward and graphs_bytes > cache.cap:
                    keeping, graphs = None, []  # larger than it may keep: the other blocks run without a graph
            else:
                hidden = yield from forward_block(call, block, hidden, prompt, block_lora, spent)
        if inputs.grad_outputs is None:
            if keeping is not None:
                cache.put(keeping.peer, keeping.key, keeping.host, start, end, adapter, forward_inputs, graphs)
            return [hidden.to("cpu", inputs.hidden.dtype)], spent.seconds * 1000
        grad = inputs.grad_outputs.to(self.device, self.dtype)
        prompt_grads: list[torch.Tensor] = []
        lora_grads: list[torch.Tensor] = []
        for block in reversed(range(start, end)):
            if graphs:
                grad, prompt_grad, lora_grad = yield from backward_block(graphs[block - start], grad, spent)
            else:
                prompt = None if prompts is None else prompts[block - start : block - start + 1]
                block_lora = None if lora is None else lora.blocks(block, block + 1)
                grad, prompt_grad, lora_grad = yield from backward_rows(
                    call, block, block_inputs.pop(), grad, prompt, block_lora, spent
                )
            if prompt_grad is not None:
                prompt_grads.insert(0, prompt_grad)
            if lora_grad is not None:
                lora_grads.insert(0, lora_grad)
        results = [grad.to("cpu", inputs.hidden.dtype)]
        if inputs.prompts is not None:
            results.append(torch.cat(prompt_grads, dim=0).to("cpu", inputs.prompts.dtype))
        if lora is not None:
            results.append(torch.cat(lora_grads).to("cpu", lora.flat.dtype))
        return results, spent.seconds * 1000

    async def step(
        self,
        cache: DynamicCache,
        start: int,
        end: int,
        inputs: SpanTensors,
        chunk_tokens: int,
        start_from: int | None = None,
        peer: str = "",
        adapter: str | None = None,
        lora: LoraWeights | None = None,
        host: str = "",
    ) -> tuple[ReplyTensors, float]:
        """One inference step of a session owning `cache`: the reply's hidden states of the new tokens, and the
        compute time in ms.

        With start_from, the cache is first cut back to that many tokens (validated: not more than it holds). A step
        with the session's own LoRA weights runs alone (never batched with other sessions' steps); a fresh session's
        plain prompt may run with other fresh sessions' prompts. A step of more tokens than a quantum (a long prompt,
        a replayed history) is long work (scheduling.Kind): it runs in quanta and takes turns with other sessions'
        short steps, which it never holds up by more than one quantum."""
        quantum = self.scheduler.limits.quantum_tokens
        long = quantum > 0 and inputs.hidden.shape[0] * inputs.hidden.shape[1] > quantum
        work = StepWork(cache, start, end, inputs, chunk_tokens, start_from, adapter, lora, long)
        decode = None
        if lora is None and _plain_decode(cache, start, inputs, start_from):
            decode = DecodeStep(start, end, inputs.hidden, cache, adapter, inputs.attention_mask, inputs.position_ids)
        elif lora is None and _plain_prompt(
            cache, start, inputs, start_from, self._prompt_limit(start, end, chunk_tokens)
        ):
            decode = DecodeStep(start, end, inputs.hidden, cache, adapter, budget=chunk_tokens)
        kind = Kind.PROMPT if long else Kind.INFERENCE
        result: tuple[ReplyTensors, float] = await self.scheduler.submit(kind, peer, work, decode, host=host)
        return result

    def _prompt_limit(self, start: int, end: int, chunk_tokens: int) -> int:
        """The most tokens of a prompt that may join others' over blocks [start, end): one that would run alone in
        one chunk, and within the sliding window of any such layer among them (a joined prompt attends causally)."""
        window = getattr(self.span.config, "sliding_window", None)
        if window is not None and SLIDING_ATTENTION in self.span.layer_kinds[start:end]:
            return min(chunk_tokens, int(window))
        return chunk_tokens

    def session_ended(self, cache: DynamicCache) -> None:
        """The session owning `cache` is over: no decode batch waits for its steps any more."""
        self.scheduler.forget(cache)

    def _decode_batch(self, steps: list[DecodeStep]) -> list[tuple[ReplyTensors, float]]:
        """One-token steps of several sessions over the same blocks, as one forward (on the compute thread); or the
        prompts of several fresh sessions (the scheduler never mixes the two)."""
        began = time.perf_counter()
        start, end = steps[0].start, steps[0].end
        with torch.inference_mode():
            hidden = [step.hidden.to(self.device, self.dtype) for step in steps]
            # the scheduler batches only steps with the same adapter
            caches = [step.cache for step in steps]
            if steps[0].prompt:
                outputs = prefill_batched(self.span, hidden, caches, start, end, steps[0].adapter)
            else:
                masks, positions = [step.mask for step in steps], [step.positions for step in steps]  # None: usual
                outputs = decode_batched(self.span, hidden, caches, start, end, steps[0].adapter, masks, positions)
            results = [out.to("cpu", step.hidden.dtype) for out, step in zip(outputs, steps, strict=True)]
        compute_ms = (time.perf_counter() - began) * 1000
        if steps[0].prompt:
            logger.debug("inference prompts sessions=%d blocks=%d:%d tokens=%d %.1f ms", len(steps), start, end,
                        sum(step.tokens for step in steps), compute_ms)  # fmt: skip
            return [(ReplyTensors(hidden=result), compute_ms) for result in results]
        logger.debug("inference batch sessions=%d blocks=%d:%d rows=%d %.1f ms", len(steps), start, end,
                    sum(step.rows for step in steps), compute_ms)  # fmt: skip
        return [(ReplyTensors(hidden=result), compute_ms) for result in results]

    def _step(
        self,
        cache: DynamicCache,
        start: int,
        end: int,
        inputs: SpanTensors,
        chunk_tokens: int,
        start_from: int | None,
        adapter: str | None = None,
        lora: LoraWeights | None = None,
        in_pieces: bool = False,
    ) -> Generator[None, int | None, tuple[list[torch.Tensor], float]]:
        """A session's step, in chunks of at most chunk_tokens so that its activations stay bounded whatever its
        length. in_pieces (a long step: scheduling.Kind.PROMPT): a piece is a chunk through one block, of the tokens
        the scheduler's quantum allows (0 or None: chunk_tokens), so other sessions' steps run in between; else the
        step is one piece. No inference mode is held across a yield."""
        spent = Spent()
        with spent, torch.inference_mode():
            if start_from is not None and start_from < cache.get_seq_length(start):
                cache.crop(start_from - cache.get_seq_length(start))  # a negative count: tokens to drop
            if inputs.hypo_ids is not None:
                # transformers annotates beam_idx as torch.LongTensor, a legacy type no tensor is inferred as
                cache.reorder_cache(inputs.hypo_ids.to(self.device))  # type: ignore[arg-type]
            hidden = inputs.hidden.to(self.device, self.dtype)
            prompts = None if inputs.prompts is None else inputs.prompts.to(self.device, self.dtype)
            lora = None if lora is None else lora.with_flat(lora.flat.to(self.device))
        batch, seq = hidden.shape[:2]
        past = cache.get_seq_length(start)
        outputs = [hidden[:, :0]]  # an empty step is a valid no-op: its reply is empty too
        budget = yield  # the one piece of a short step; a long one's first
        begin = 0
        while begin < seq:
            stop = min(seq, begin + max(1, min(chunk_tokens, (budget if in_pieces else 0) or chunk_tokens) // batch))
            mask = None if inputs.attention_mask is None else inputs.attention_mask[:, : past + stop]
            mask = None if mask is None else mask.to(self.device)
            positions = None if inputs.position_ids is None else inputs.position_ids[:, begin:stop]
            positions = None if positions is None else positions.to(self.device)
            out = hidden[:, begin:stop]
            for first, last in [(b, b + 1) for b in range(start, end)] if in_pieces else [(start, end)]:
                if first > start:
                    budget = yield  # a long step's next piece: its chunk through the next block
                block_prompts = None if prompts is None else prompts[first - start : last - start]
                block_lora = None if lora is None else lora.blocks(first, last)
                with spent, torch.inference_mode():
                    out = self.span(
                        out, start=first, end=last, cache=cache, prompts=block_prompts, adapter=adapter,
                        lora=block_lora, attention_mask=mask, position_ids=positions,
                    )  # fmt: skip
            outputs.append(out)
            begin = stop
            if begin < seq and in_pieces:
                budget = yield  # the next chunk's first piece
        with spent, torch.inference_mode():
            result = torch.cat(outputs, dim=1).to("cpu", inputs.hidden.dtype)
        return [result], spent.seconds * 1000

    def measure_throughput(self, tokens: int = 128) -> float:
        """Tokens per second through one block (the span's first), in forwards of `tokens` random tokens: the median
        of warm rounds (server/speed.py)."""
        inputs = SpanTensors(torch.randn(1, tokens, self.limits.hidden_size))
        start = self.span.start
        return median_rate(lambda: self._run(start, start + 1, inputs)[1] / 1000, tokens)

    def measure_inference_throughput(self, past: int = 32) -> float:
        """One-token decode steps per second through one block (the span's first) with `past` tokens cached: the
        median of warm rounds, each step written at the same position (server/speed.py)."""
        cache = GrowingCache()
        start = self.span.start
        whole(
            self._step(cache, start, start + 1, SpanTensors(torch.randn(1, past, self.limits.hidden_size)), past, None)
        )
        token = SpanTensors(torch.randn(1, 1, self.limits.hidden_size))
        return median_rate(lambda: whole(self._step(cache, start, start + 1, token, 1, past))[1] / 1000, 1)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


R = TypeVar("R")


def whole(pieces: Generator[None, int | None, R]) -> R:
    """What a computation in pieces returns, run at once (every piece of the size it chooses itself)."""
    while True:
        try:
            pieces.send(None)
        except StopIteration as done:
            result: R = done.value
            return result


def _named(inputs: SpanTensors, results: list[torch.Tensor]) -> ReplyTensors:
    """The reply of a forward or backward of `inputs` from its results as _run_by_block returns them: [hidden] for
    a forward, [grad wrt hidden, (grad wrt prompts), (grad wrt lora)] for a backward."""
    if inputs.grad_outputs is None:
        (hidden,) = results
        return ReplyTensors(hidden=hidden)
    grads = list(results[1:])
    grad_prompts = None if inputs.prompts is None else grads.pop(0)
    grad_lora = None if inputs.lora is None else grads.pop(0)
    if grads:
        raise RuntimeError(f"a backward gave {len(results)} results, more than its request asked for")
    return ReplyTensors(grad_hidden=results[0], grad_prompts=grad_prompts, grad_lora=grad_lora)


def _plain_decode(cache: DynamicCache, start: int, inputs: SpanTensors, start_from: int | None) -> bool:
    """A step that may share a forward with other sessions': one new token per row after the session's history,
    with no prompts, LoRA weights, reordering or rollback (anything else runs alone). A padded batch's mask (over
    the history and the new token, which each row sees) and its rows' own positions go with the step."""
    rows = inputs.hidden.shape[0]
    if inputs.hidden.shape[1] != 1 or inputs.hypo_ids is not None or inputs.prompts is not None:
        return False
    if inputs.lora is not None or inputs.grad_outputs is not None:
        return False
    past = cache.get_seq_length(start)
    if start_from is not None and start_from != past:
        return False
    mask = inputs.attention_mask
    if mask is not None and (tuple(mask.shape) != (rows, past + 1) or not bool(mask[:, -1].all())):
        return False
    return inputs.position_ids is None or tuple(inputs.position_ids.shape) == (rows, 1)


def _plain_prompt(
    cache: DynamicCache, start: int, inputs: SpanTensors, start_from: int | None, max_tokens: int
) -> bool:
    """A step that may share a forward with other fresh sessions' prompts: the first tokens (2 to max_tokens, one
    row) of a session holding nothing yet, at positions 0, 1, ..., without padding, prompts, LoRA weights or
    reordering (anything else runs alone)."""
    hidden = inputs.hidden
    if hidden.dim() != 3 or hidden.shape[0] != 1 or not 1 < hidden.shape[1] <= max_tokens:
        return False
    if inputs.hypo_ids is not None or inputs.prompts is not None or inputs.lora is not None:
        return False
    if inputs.grad_outputs is not None or start_from not in (None, 0) or cache.get_seq_length(start) != 0:
        return False
    tokens = hidden.shape[1]
    mask, positions = inputs.attention_mask, inputs.position_ids
    if mask is not None and (tuple(mask.shape) != (1, tokens) or not bool(mask.all())):
        return False
    return positions is None or (
        tuple(positions.shape) == (1, tokens) and torch.equal(positions[0].long(), torch.arange(tokens))
    )
