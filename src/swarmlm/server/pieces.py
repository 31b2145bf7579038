"""A forward or backward over a span in pieces, so other work (a session's decode step) runs in between: a block at a
time, and a block's tokens in chunks when the scheduler asks for small pieces.

A chunk of a block attends to the keys/values of the chunks before it through a temporary KV cache (as a chunked
prefill does). Under autograd those keys/values enter a chunk's graph as leaves; the backward runs the chunks from
the last one and adds what each chunk's gradient wrt them says to the gradient of the earlier chunks' own keys and
values, so every input gets the gradient autograd through the whole block gives (summed in another order).

A piece generator yields before each piece and is sent the piece's size: the most tokens (rows x positions) of
forward work it runs, 0 or None for the rest of the block at once. A forward without autograd also keeps each piece
within SpanCall.piece_tokens, whatever the size sent: its activations would otherwise grow with the request (a block
holds ~16 times its input while it runs), so that what a peer's request makes a server hold while it computes stays
bounded.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field, replace
from types import TracebackType

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache, DynamicLayer

from swarmlm.models.span import SpanModel
from swarmlm.protocol.lora import LoraWeights

KeysValues = tuple[torch.Tensor, torch.Tensor]  # keys, values: (rows, kv heads, positions, head dim) each

# the bytes of activations one piece of a forward may hold at once (beside the request's input and output). A forward
# of 32,768 tokens (128 x 256) through the tests' tiny Llama grew the process by 114-156 MB run whole and by 51-54 MB
# in pieces, in the same time (one thread). Groups of rows cost nothing; a row longer than a piece runs its positions
# in chunks, which costs SmolLM2 (780 tokens a piece in float32) 4-11% at 2,048 tokens and 16% at 4,096
PIECE_BYTES = 32 << 20
# the autograd graphs a backward that recomputes its forward may build for its whole span at once (one such
# computation runs at a time: server.scheduling.Task.exclusive); a larger one keeps only its blocks' inputs and builds
# one block's graph for a group of rows at a time (backward_rows), at the cost of one more forward without a graph:
# a backward of 32 x 256 tokens through 5 blocks of SmolLM2 peaked at +1,827 MB of RSS with every graph built at once,
# +190 MB this way, in 1.17x the time (1.28x for 8 x 128 tokens, +235 MB -> +77)
RECOMPUTE_GRAPH_BYTES = 8 * PIECE_BYTES


def piece_tokens(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """The most tokens a block's forward runs at once for its activations to stay within PIECE_BYTES: per token,
    a Llama-shaped block holds ~8 vectors of the hidden size (norms, queries, keys, values, attention output and
    projection, residuals) and ~4 of the MLP's (gate, up, activation, product; per routed expert)."""
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    experts = getattr(config, "num_experts_per_tok", None) or 1
    per_token = (8 * hidden + 4 * intermediate * experts) * torch.empty((), dtype=dtype).element_size()
    return max(1, PIECE_BYTES // per_token)


@dataclass(frozen=True)
class SpanCall:
    """What every piece of one computation over a span reads."""

    span: SpanModel
    mask: torch.Tensor | None  # (rows, seq): the padding mask, on the device
    positions: torch.Tensor | None  # (rows, seq): the rows' position ids, on the device
    adapter: str | None
    piece_tokens: int = 0  # the most tokens a forward's piece runs (0: as many as sent); see piece_tokens()

    def rows(self, first: int, stop: int) -> SpanCall:
        """The call for rows [first, stop) of the request."""
        mask = None if self.mask is None else self.mask[first:stop]
        positions = None if self.positions is None else self.positions[first:stop]
        return replace(self, mask=mask, positions=positions)

    def run(
        self, hidden: torch.Tensor, block: int, begin: int, cache: DynamicCache | None, prompt: torch.Tensor | None,
        lora: LoraWeights | None,
    ) -> torch.Tensor:  # fmt: skip
        """Block `block` over hidden, the positions [begin, begin + its length) of the request (cache: the earlier
        positions' keys/values; None when hidden is all of them)."""
        stop = begin + hidden.shape[1]
        mask = None if self.mask is None else self.mask[:, :stop]
        positions = None if self.positions is None else self.positions[:, begin:stop]
        return self.span(
            hidden, start=block, end=block + 1, attention_mask=mask, position_ids=positions, cache=cache,
            prompts=prompt, adapter=self.adapter, lora=lora,
        )  # fmt: skip


@dataclass
class Spent:
    """Compute time of a computation's pieces (not the time other work ran in between)."""

    seconds: float = 0.0
    _began: float = 0.0

    def __enter__(self) -> None:
        self._began = time.perf_counter()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.seconds += time.perf_counter() - self._began


@dataclass
class Chunk:
    """A chunk of a block's forward, kept for its backward: its leaves and its outputs."""

    begin: int  # positions [begin, stop) of the request
    stop: int
    hidden: torch.Tensor  # leaf: the block's input at those positions, (rows, stop - begin, hidden)
    past: KeysValues | None  # leaves: the keys/values of positions [0, begin) (None for the first chunk)
    output: torch.Tensor  # (rows, stop - begin, hidden)
    present: KeysValues | None  # its own keys/values, read by later chunks (None: the block's only chunk)


class Storages(dict[int, int]):
    """What a graph holds, storage address -> bytes, counted by a saved-tensor hook.

    A graph freed (taken by its backward, evicted, expired) must free its memory with it, so the hook makes no
    reference cycle through autograd's C++ nodes, which the garbage collector cannot see: it is this object, not a
    method of the graph (autograd keeps the hook alive with every tensor saved under it), and what it packs is the
    tensor detached (a node saving its own output would otherwise hold the output, whose grad_fn is that node)."""

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count a tensor the graph holds; its data, packed for the backward. Frozen weights, which neither require
        grad nor come from a computation that does, are not the graph's."""
        if tensor.requires_grad or tensor.grad_fn is not None:
            storage = tensor.untyped_storage()
            self[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()


@dataclass
class BlockGraph:
    """A block's forward under autograd, as chunks, with the leaves its request's own weights entered as."""

    prompt: torch.Tensor | None  # leaf: the block's deep prompt, (1, prefix, hidden)
    lora: LoraWeights | None  # the block's LoRA weights, their flat tensor a leaf
    chunks: list[Chunk] = field(default_factory=list)
    storages: Storages = field(default_factory=Storages)  # what the graph holds: storage address -> bytes

    @property
    def nbytes(self) -> int:
        """Memory the graph holds: the activations autograd saved for the backward and the outputs (each storage
        once; not the frozen weights)."""
        return sum(self.storages.values())


def chunk_stop(begin: int, seq: int, rows: int, budget: int | None) -> int:
    """The end of the chunk of positions starting at `begin` that `budget` tokens allow (at least one position)."""
    return seq if not budget else min(seq, begin + max(1, budget // rows))


def forward_block(
    call: SpanCall, block: int, hidden: torch.Tensor, prompt: torch.Tensor | None, lora: LoraWeights | None,
    spent: Spent,
) -> Generator[None, int | None, torch.Tensor]:  # fmt: skip
    """Block `block` over hidden (rows, seq, hidden) without autograd, in chunks of the sizes sent and at most
    call.piece_tokens each: groups of whole rows while a row fits (rows are independent: no cache between them), a
    row's positions in chunks when it does not. Each chunk's output is written over its input, which nothing reads
    after it (the later chunks of a row read the earlier ones' keys and values from the cache): the block's output
    is `hidden` itself, and a request holds one copy of its hidden states while it runs, not its input, its output
    and the output's pieces."""
    for first, stop, rows_call, rows_prompt in _row_groups(call, hidden, prompt):
        yield from _forward_rows(rows_call, block, hidden[first:stop], rows_prompt, lora, spent)
    return hidden


def _per_row(prompt: torch.Tensor | None, rows: int) -> bool:
    """Whether a block's deep prompt is one per row, (1, rows, prefix, hidden), rather than shared."""
    return prompt is not None and prompt.dim() == 4 and prompt.shape[1] == rows


def _row_groups(
    call: SpanCall, hidden: torch.Tensor, prompt: torch.Tensor | None
) -> Iterator[tuple[int, int, SpanCall, torch.Tensor | None]]:
    """The groups of whole rows [first, stop) that a block's work over hidden (rows, seq, hidden) runs in, as many
    rows as call.piece_tokens allows (at least one), each with its call and its deep prompt (a per-row prompt's
    rows, a shared prompt whole)."""
    rows, seq = hidden.shape[:2]
    group = rows if not call.piece_tokens else max(1, min(rows, call.piece_tokens // max(1, seq)))
    per_row = _per_row(prompt, rows)
    for first in range(0, rows, group):
        stop = min(rows, first + group)
        rows_prompt = prompt[:, first:stop] if per_row and prompt is not None else prompt
        yield first, stop, (call if group == rows else call.rows(first, stop)), rows_prompt


def _forward_rows(
    call: SpanCall, block: int, hidden: torch.Tensor, prompt: torch.Tensor | None, lora: LoraWeights | None,
    spent: Spent,
) -> Generator[None, int | None, None]:  # fmt: skip
    """forward_block over all the rows of hidden at once, in chunks of positions, each written over its input."""
    rows, seq = hidden.shape[:2]
    cache, begin = DynamicCache(), 0
    while True:
        budget = yield
        if call.piece_tokens:
            budget = min(budget or call.piece_tokens, call.piece_tokens)
        stop = chunk_stop(begin, seq, rows, budget)
        with spent, torch.inference_mode():
            past = None if begin == 0 and stop == seq else cache  # one chunk: no cache, as the block runs unchunked
            hidden[:, begin:stop] = call.run(hidden[:, begin:stop], block, begin, past, prompt, lora)
        begin = stop
        if begin >= seq:
            return


def forward_block_graph(
    call: SpanCall, block: int, hidden: torch.Tensor, prompt: torch.Tensor | None, lora: LoraWeights | None,
    spent: Spent,
) -> Generator[None, int | None, tuple[torch.Tensor, BlockGraph]]:  # fmt: skip
    """Block `block` over hidden (rows, seq, hidden) under autograd, in chunks of the sizes sent: its output
    (detached) and its graph, for backward_block."""
    rows, seq = hidden.shape[:2]
    graph = BlockGraph(
        None if prompt is None else prompt.detach().requires_grad_(),
        None if lora is None else lora.with_flat(lora.flat.detach().requires_grad_()),
    )
    past: KeysValues | None = None  # detached keys/values of the chunks so far
    begin = 0
    while begin < seq or not graph.chunks:
        budget = yield
        stop = chunk_stop(begin, seq, rows, budget)
        with spent, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(graph.storages, _unpacked):
            chunk, past = _graph_chunk(call, block, hidden, begin, stop, past, graph)
        graph.storages(chunk.output)
        graph.chunks.append(chunk)
        begin = stop
    if len(graph.chunks) == 1:
        return graph.chunks[0].output.detach(), graph
    with torch.no_grad():
        return torch.cat([chunk.output for chunk in graph.chunks], dim=1), graph


def _unpacked(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _graph_chunk(
    call: SpanCall, block: int, hidden: torch.Tensor, begin: int, stop: int, past: KeysValues | None,
    graph: BlockGraph,
) -> tuple[Chunk, KeysValues | None]:  # fmt: skip
    """The chunk of positions [begin, stop) of `block` under autograd, its input and the earlier keys/values as
    leaves; with the keys/values of positions [0, stop), detached, for the next chunk."""
    chunk_input = hidden[:, begin:stop].detach().requires_grad_()
    if begin == 0 and stop == hidden.shape[1]:  # the block's only chunk: no cache, as the block runs unchunked
        output = call.run(chunk_input, block, 0, None, graph.prompt, graph.lora)
        return Chunk(begin, stop, chunk_input, None, output, None), None
    cache = DynamicCache()
    leaves = None if past is None else (past[0].detach().requires_grad_(), past[1].detach().requires_grad_())
    if leaves is not None:
        cache.update(leaves[0], leaves[1], block)
    output = call.run(chunk_input, block, begin, cache, graph.prompt, graph.lora)
    layer = cache.layers[block]
    if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
        raise RuntimeError(f"block {block} did not store its keys and values in the cache")
    keys, values = layer.keys, layer.values
    present = (keys[..., begin:, :], values[..., begin:, :])  # this chunk's own, in its graph
    return Chunk(begin, stop, chunk_input, leaves, output, present), (keys.detach(), values.detach())


def backward_block(
    graph: BlockGraph, grad: torch.Tensor, spent: Spent
) -> Generator[None, int | None, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """The gradients wrt a block's input (rows, seq, hidden), its prompt and its LoRA weights' flat tensor, from
    grad wrt its output, in pieces of chunks (the last chunk first) within the sizes sent."""
    rows = grad.shape[0]
    waiting = list(reversed(graph.chunks))
    grads = _BlockGrads()
    while waiting:
        budget = yield
        piece = [waiting.pop(0)]
        tokens = (piece[0].stop - piece[0].begin) * rows
        while waiting and (not budget or tokens + (waiting[0].stop - waiting[0].begin) * rows <= budget):
            tokens += (waiting[0].stop - waiting[0].begin) * rows
            piece.append(waiting.pop(0))
        with spent, torch.enable_grad():
            for chunk in piece:
                grads.add(chunk, graph, grad[:, chunk.begin : chunk.stop])
    return grads.result(graph)


def backward_rows(
    call: SpanCall, block: int, hidden: torch.Tensor, grad: torch.Tensor, prompt: torch.Tensor | None,
    lora: LoraWeights | None, spent: Spent,
) -> Generator[None, int | None, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:  # fmt: skip
    """backward_block of block `block` over its input hidden (rows, seq, hidden), from grad wrt its output, its graph
    rebuilt here a group of whole rows at a time (as forward_block groups them, call.piece_tokens tokens) and taken
    by that group's backward before the next group's is built. A block's graph holds ~16 times its input: the graph
    held at once is a group's, whatever the request's size (a row longer than a piece is one group). Rows are
    independent in a block, so each group's input gradient is its rows'; the gradients wrt a shared prompt and the
    LoRA weights are summed over the groups, a per-row prompt's gathered by rows."""
    per_row = _per_row(prompt, hidden.shape[0])
    grad_input = torch.empty_like(grad)
    row_prompt_grads: list[torch.Tensor] = []
    prompt_grad: torch.Tensor | None = None
    lora_grad: torch.Tensor | None = None
    for first, stop, rows_call, rows_prompt in _row_groups(call, hidden, prompt):
        _, graph = yield from forward_block_graph(rows_call, block, hidden[first:stop], rows_prompt, lora, spent)
        rows_grad, rows_prompt_grad, rows_lora_grad = yield from backward_block(graph, grad[first:stop], spent)
        del graph  # before the next group's is built
        grad_input[first:stop] = rows_grad
        if per_row and rows_prompt_grad is not None:
            row_prompt_grads.append(rows_prompt_grad)
        else:
            prompt_grad = _sum(prompt_grad, rows_prompt_grad)
        lora_grad = _sum(lora_grad, rows_lora_grad)
    if row_prompt_grads:
        prompt_grad = torch.cat(row_prompt_grads, dim=1)
    return grad_input, prompt_grad, lora_grad


@dataclass
class _BlockGrads:
    """Gradients of a block's leaves gathered chunk by chunk, the last chunk first."""

    inputs: list[torch.Tensor] = field(default_factory=list)  # wrt each chunk's input, the last chunk's first
    keys_values: list[torch.Tensor] | None = None  # wrt the keys, values of positions before the chunks done so far
    prompt: torch.Tensor | None = None
    lora: torch.Tensor | None = None

    def add(self, chunk: Chunk, graph: BlockGraph, grad: torch.Tensor) -> None:
        """Backward of one chunk with grad wrt its output (and, gathered from the later chunks, wrt its keys and
        values)."""
        outputs, grad_outputs = [chunk.output], [grad]
        if chunk.present is not None and self.keys_values is not None:
            outputs += list(chunk.present)
            grad_outputs += [g[..., chunk.begin : chunk.stop, :] for g in self.keys_values]
        wrt = [chunk.hidden, *(chunk.past or ())]
        wrt += [] if graph.prompt is None else [graph.prompt]
        wrt += [] if graph.lora is None else [graph.lora.flat]
        # allow_unused: a chunk past the prompt's prefix, or LoRA modules the output does not depend on
        found = list(torch.autograd.grad(outputs, wrt, grad_outputs=grad_outputs, allow_unused=True))
        self.inputs.append(_or_zeros(found.pop(0), chunk.hidden))
        if chunk.past is not None:
            past_grads = [_or_zeros(found.pop(0), leaf) for leaf in chunk.past]
            if self.keys_values is None:
                self.keys_values = past_grads
            else:
                for total, part in zip(self.keys_values, past_grads, strict=True):
                    total[..., : chunk.begin, :] += part
        if graph.prompt is not None:
            self.prompt = _sum(self.prompt, found.pop(0))
        if graph.lora is not None:
            self.lora = _sum(self.lora, found.pop(0))

    def result(self, graph: BlockGraph) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        grad_input = self.inputs[0] if len(self.inputs) == 1 else torch.cat(self.inputs[::-1], dim=1)
        prompt = None if graph.prompt is None else _or_zeros(self.prompt, graph.prompt)
        lora = None if graph.lora is None else _or_zeros(self.lora, graph.lora.flat)
        return grad_input, prompt, lora


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad


def _sum(total: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    if part is None:
        return total
    return part if total is None else total + part
