"""A long forward/backward in pieces (server.pieces): a block's tokens in chunks of any sizes give what autograd
through the whole span gives, padding, positions, deep prompts and the request's own LoRA weights included, for
every attention kind (full, sliding, soft-capped)."""

from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmlm.models.lora import linear_shapes
from swarmlm.models.span import SpanModel
from swarmlm.protocol.bundle import SpanTensors
from swarmlm.protocol.lora import LoraSpec, LoraWeights, lora_layout
from swarmlm.server.backend import SpanBackend
from tests.tiny_families import build_tiny

ROWS, SEQ, PREFIX = 2, 11, 4
# sizes sent to the pieces, in turn (tokens: rows x positions; 0 = the rest of the block): chunks of 3, 1 and 2
# positions and the rest, so chunk bounds fall inside the prompt's prefix and the sliding windows
BUDGETS = [6, 0, 2, 4]


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma2"])
def span(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SpanModel:
    folder = build_tiny(request.param, tmp_path_factory.mktemp(request.param))
    return SpanModel.from_dir(folder, 1, 4)


def drive(pieces: Generator[None, int | None, Any], budgets: list[int]) -> tuple[Any, int]:
    """Run a piece generator to its end, sending the budgets in turn: its result and how many pieces it ran."""
    sizes = itertools.cycle(budgets)
    next(pieces)
    count = 0
    while True:
        count += 1
        try:
            pieces.send(next(sizes))
        except StopIteration as done:
            return done.value, count


def request(span: SpanModel, backward: bool) -> tuple[SpanTensors, LoraWeights]:
    generator = torch.Generator().manual_seed(0)
    hidden_size, blocks = span.config.hidden_size, span.end - span.start
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[0, :3] = 0  # a left-padded row
    lora_shapes = [linear_shapes(layer) for layer in span.layers]
    layout = lora_layout(lora_shapes, 2, ("q_proj", "v_proj", "down_proj"))
    flat = torch.randn(layout.size, generator=generator) * 0.3
    # a loss over the real tokens gives padded positions no gradient (their outputs, which attend to no token, are
    # whatever the attention makes of an empty row: another chunking gives other ones)
    grad = torch.randn(ROWS, SEQ, hidden_size, generator=generator) * mask.unsqueeze(-1)
    inputs = SpanTensors(
        torch.randn(ROWS, SEQ, hidden_size, generator=generator),
        grad_outputs=grad if backward else None,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        prompts=torch.randn(blocks, PREFIX, hidden_size, generator=generator),
    )
    return inputs, LoraWeights(
        LoraSpec(rank=2, scaling=2.0, targets=("q_proj", "v_proj", "down_proj")), layout, flat, span.start
    )


def whole_span(span: SpanModel, inputs: SpanTensors, lora: LoraWeights) -> list[torch.Tensor]:
    """Autograd through the whole span in one call: output, and (with grad_outputs) the gradients wrt the hidden
    states, the prompts and the LoRA weights."""
    leaves = [t.clone().requires_grad_() for t in (inputs.hidden, inputs.prompts, lora.flat) if t is not None]
    with torch.enable_grad():
        output = span(
            leaves[0], attention_mask=inputs.attention_mask, position_ids=inputs.position_ids, prompts=leaves[1],
            lora=lora.with_flat(leaves[2]),
        )  # fmt: skip
        if inputs.grad_outputs is None:
            return [output.detach()]
        return list(torch.autograd.grad(output, leaves, grad_outputs=inputs.grad_outputs))


@pytest.mark.parametrize(("backward", "checkpointed"), [(False, False), (True, False), (True, True)],
                         ids=["forward", "backward", "backward-checkpointed"])  # fmt: skip
def test_chunks_of_any_size_give_the_whole_spans_results(span: SpanModel, backward: bool, checkpointed: bool) -> None:
    backend = SpanBackend(span, torch.float32, "cpu", 8192)
    if checkpointed:
        backend._recompute_graph_bytes = 0  # every backward keeps its blocks' inputs, not their graphs
    inputs, lora = request(span, backward)
    expected = whole_span(span, inputs, lora)
    rows_valid = inputs.attention_mask.bool() if inputs.attention_mask is not None else None
    counts = []
    for budgets in ([0], BUDGETS, [2]):
        (results, _), pieces = drive(backend._run_by_block(span.start, span.end, inputs, None, lora), budgets)
        counts.append(pieces)
        assert len(results) == len(expected)
        for result, reference in zip(results, expected, strict=True):
            if result.shape[:2] == (ROWS, SEQ) and rows_valid is not None:  # padded positions are never read
                result, reference = result[rows_valid], reference[rows_valid]
            assert (result - reference).abs().max().item() <= 1e-5 * max(1.0, reference.abs().max().item())
    blocks = span.end - span.start
    # a block at a time; a checkpointed backward runs the forward of every block but the last without a graph, then
    # rebuilds each block's graph and runs its backward, from the last block
    assert counts[0] == (blocks - 1 + 2 * blocks if checkpointed else blocks * (2 if backward else 1))
    assert counts[1] >= 2.5 * counts[0] and counts[2] == counts[0] * SEQ  # chunks of blocks
    backend.shutdown()


def test_without_a_budget_a_piece_is_a_whole_block(tmp_path: Path) -> None:
    span = SpanModel.from_dir(build_tiny("llama", tmp_path), 0, 4)
    backend = SpanBackend(span, torch.float32, "cpu", 8192)
    inputs, lora = request(span, backward=True)
    _, pieces = drive(backend._run_by_block(0, 4, inputs, None, lora), [0])
    assert pieces == 4 + 4  # forward and backward of each block
    backend.shutdown()


@pytest.mark.parametrize(("piece_tokens", "pieces_per_block"), [(2 * SEQ, 3), (4, 5 * 3)], ids=["rows", "positions"])
def test_a_forward_runs_in_pieces_of_bounded_tokens_with_the_whole_spans_results(
    span: SpanModel, piece_tokens: int, pieces_per_block: int
) -> None:
    """However large a forward, no piece of it computes more than the backend's piece_tokens at once (its activations
    stay bounded): groups of whole rows while a row fits (5 rows, 2 a piece: 3 pieces), else each row's positions in
    chunks (11 positions, 4 a piece: 3 chunks for each of 5 rows), with padding, positions, per-row deep prompts and
    the request's own LoRA weights."""
    backend = SpanBackend(span, torch.float32, "cpu", 8192)
    backend._piece_tokens = piece_tokens
    generator = torch.Generator().manual_seed(1)
    rows, hidden_size, blocks = 5, span.config.hidden_size, span.end - span.start
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    mask[1, :3] = 0
    mask[4, :5] = 0
    inputs = SpanTensors(
        torch.randn(rows, SEQ, hidden_size, generator=generator),
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        prompts=torch.randn(blocks, rows, PREFIX, hidden_size, generator=generator),
    )
    _, lora = request(span, backward=False)
    with torch.inference_mode():
        expected = span(
            inputs.hidden, attention_mask=mask, position_ids=inputs.position_ids, prompts=inputs.prompts, lora=lora
        )
    for budgets, owned in (([0], False), ([SEQ * rows], True)):  # the scheduler's sizes never make a piece larger
        sent = inputs.hidden.clone()
        run = backend._run_by_block(span.start, span.end, replace(inputs, hidden=sent), None, lora, owned=owned)
        (results, _), pieces = drive(run, budgets)
        valid = mask.bool()
        assert (results[0][valid] - expected[valid]).abs().max().item() <= 1e-5 * expected.abs().max().item()
        assert pieces == blocks * pieces_per_block
        # each piece's output is written over its input: a request off the wire (owned) holds one copy of its hidden
        # states, not its input, its output and the output's pieces; any other caller's input is left as it was
        assert (results[0].data_ptr() == sent.data_ptr()) is owned
        assert owned or torch.equal(sent, inputs.hidden)
    backend.shutdown()


def test_a_recomputed_backward_builds_a_group_of_rows_graph_at_a_time_with_the_whole_spans_gradients(
    span: SpanModel,
) -> None:
    """A backward with no kept graph keeps each block's input, not its graph, then rebuilds each block's graph a
    group of rows at a time (5 rows, 2 a piece: 3 groups), each taken by its backward before the next is built: the
    gradients wrt the input, the per-row deep prompts and the LoRA weights are those of autograd through the whole
    span, with padding and positions."""
    backend = SpanBackend(span, torch.float32, "cpu", 8192)
    backend._piece_tokens = 2 * SEQ
    backend._recompute_graph_bytes = 0  # as a large request's backward would
    generator = torch.Generator().manual_seed(2)
    rows, hidden_size, blocks = 5, span.config.hidden_size, span.end - span.start
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    mask[2, :4] = 0
    _, lora = request(span, backward=False)
    inputs = SpanTensors(
        torch.randn(rows, SEQ, hidden_size, generator=generator),
        grad_outputs=torch.randn(rows, SEQ, hidden_size, generator=generator) * mask.unsqueeze(-1),
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        prompts=torch.randn(blocks, rows, PREFIX, hidden_size, generator=generator),
    )
    expected = whole_span(span, inputs, lora)
    sent = inputs.hidden.clone()
    (results, _), pieces = drive(backend._run_by_block(span.start, span.end, inputs, None, lora), [0])
    assert torch.equal(inputs.hidden, sent)  # the request's input is not written over
    valid = mask.bool()
    for index, (result, reference) in enumerate(zip(results, expected, strict=True)):
        if index == 0:
            result, reference = result[valid], reference[valid]
        assert (result - reference).abs().max().item() <= 1e-5 * max(1.0, reference.abs().max().item())
    # the blocks but the last forward without a graph, then each block's 3 groups: a graph, then its backward
    assert pieces == (blocks - 1) * 3 + blocks * 3 * 2
    backend.shutdown()


def test_a_pieces_activations_are_bounded_in_bytes() -> None:
    """The tokens of a piece follow the block's width: fewer for wider blocks and larger dtypes."""
    from transformers import LlamaConfig

    from swarmlm.server.pieces import PIECE_BYTES, piece_tokens

    narrow = LlamaConfig(hidden_size=64, intermediate_size=128)
    wide = LlamaConfig(hidden_size=4096, intermediate_size=14336)
    assert piece_tokens(narrow, torch.float32) == PIECE_BYTES // ((8 * 64 + 4 * 128) * 4)
    assert piece_tokens(wide, torch.bfloat16) == PIECE_BYTES // ((8 * 4096 + 4 * 14336) * 2)
    assert piece_tokens(wide, torch.float32) < piece_tokens(wide, torch.bfloat16) < piece_tokens(narrow, torch.float32)
