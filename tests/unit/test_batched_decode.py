"""Decode steps of several sessions run as one forward give each session exactly what it gets alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.cache_utils import DynamicCache

from swarmlm.models.batched import decode_batched, prefill_batched
from swarmlm.models.span import SpanModel


def test_batched_decode_equals_each_session_alone(tiny_model_dir: Path) -> None:
    torch.manual_seed(1)
    span = SpanModel.from_dir(tiny_model_dir, 1, 4)
    start, end = 2, 4  # a sub-range that does not begin at block 0: caches are addressed by global layer index
    lengths, rows = [5, 0, 12, 1, 7], [1, 1, 2, 1, 1]
    alone, batched = [], []
    with torch.inference_mode():
        for length, row in zip(lengths, rows, strict=True):
            prefix = torch.randn(row, length, 64)
            caches = [DynamicCache(), DynamicCache()]
            for cache in caches:
                if length:
                    span(prefix, start=start, end=end, cache=cache)
            alone.append(caches[0])
            batched.append(caches[1])
        for _ in range(3):  # several steps: the caches each session keeps go on growing correctly
            tokens = [torch.randn(row, 1, 64) for row in rows]
            expected = [span(t, start=start, end=end, cache=c) for t, c in zip(tokens, alone, strict=True)]
            got = decode_batched(span, tokens, batched, start, end)
            for e, g in zip(expected, got, strict=True):
                assert g.shape == e.shape
                assert (g - e).abs().max().item() <= 1e-5
            for a, b in zip(alone, batched, strict=True):
                assert a.get_seq_length(start) == b.get_seq_length(start)
                for layer in range(start, end):
                    assert (a.layers[layer].keys - b.layers[layer].keys).abs().max().item() <= 1e-5


def test_fresh_sessions_prompts_run_together_as_each_alone(tiny_model_dir: Path) -> None:
    """Prompts of several fresh sessions as one forward: each session's output and cache are what its prompt alone
    gives, and its decode steps go on from there as they would alone."""
    torch.manual_seed(2)
    span = SpanModel.from_dir(tiny_model_dir, 1, 4)
    start, end = 2, 4
    prompts = [torch.randn(1, length, 64) for length in (5, 2, 9, 3)]
    alone, together = [DynamicCache() for _ in prompts], [DynamicCache() for _ in prompts]
    with torch.inference_mode():
        expected = [span(p, start=start, end=end, cache=c) for p, c in zip(prompts, alone, strict=True)]
        got = prefill_batched(span, prompts, together, start, end)
        for e, g in zip(expected, got, strict=True):
            assert g.shape == e.shape
            assert (g - e).abs().max().item() <= 1e-5
        for _ in range(2):
            tokens = [torch.randn(1, 1, 64) for _ in prompts]
            expected = [span(t, start=start, end=end, cache=c) for t, c in zip(tokens, alone, strict=True)]
            got = decode_batched(span, tokens, together, start, end)
            for e, g in zip(expected, got, strict=True):
                assert (g - e).abs().max().item() <= 1e-5
        for a, b in zip(alone, together, strict=True):
            assert a.get_seq_length(start) == b.get_seq_length(start)
        with pytest.raises(ValueError, match="nothing cached"):  # a session with history is no fresh prompt
            prefill_batched(span, prompts[:2], together[:2], start, end)


def test_which_prompts_may_share_a_forward() -> None:
    """The first tokens of a fresh session, one row, without padding or other positions, within the limit; a
    session with history, a batch of rows, a padded prompt, shifted positions or deep prompts run alone."""
    from swarmlm.protocol.bundle import SpanTensors
    from swarmlm.server.backend import _plain_prompt

    fresh, used = DynamicCache(), DynamicCache()
    used.update(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), 0)
    hidden = torch.zeros(1, 6, 8)
    assert _plain_prompt(fresh, 0, SpanTensors(hidden), None, 64)
    assert _plain_prompt(fresh, 0, SpanTensors(hidden), 0, 64)
    ones, positions = torch.ones(1, 6, dtype=torch.long), torch.arange(6).unsqueeze(0)
    assert _plain_prompt(fresh, 0, SpanTensors(hidden, attention_mask=ones, position_ids=positions), None, 64)
    assert not _plain_prompt(fresh, 0, SpanTensors(hidden), None, 5)  # over the limit
    assert not _plain_prompt(used, 0, SpanTensors(hidden), None, 64)
    assert not _plain_prompt(fresh, 0, SpanTensors(torch.zeros(2, 6, 8)), None, 64)
    assert not _plain_prompt(fresh, 0, SpanTensors(torch.zeros(1, 1, 8)), None, 64)  # one token: a decode step
    padded = ones.clone()
    padded[0, 0] = 0
    assert not _plain_prompt(fresh, 0, SpanTensors(hidden, attention_mask=padded), None, 64)
    assert not _plain_prompt(fresh, 0, SpanTensors(hidden, position_ids=positions + 2), None, 64)
    assert not _plain_prompt(fresh, 0, SpanTensors(hidden, prompts=torch.zeros(1, 2, 8)), None, 64)


def test_cpu_float32_spans_keep_linear_weights_column_major_with_their_values(tiny_model_dir: Path) -> None:
    """A batch of decode steps multiplies a few rows by every Linear weight: on CPU float32 the weights are stored
    transposed in memory (faster there), yet read as the checkpoint's (out, in) values by everyone else."""
    from swarmlm.models.loading import load_tensors

    span = SpanModel.from_dir(tiny_model_dir, 1, 3)
    stored = load_tensors(tiny_model_dir, ["model.layers.1.", "model.layers.2."], dtype=torch.float32)
    linears = [(name, m) for name, m in span.layers.named_modules() if type(m) is torch.nn.Linear]
    assert linears
    for name, module in linears:
        weight = module.weight
        assert weight.stride() == (1, weight.shape[0]), name
        index, rest = name.split(".", 1)
        assert torch.equal(weight, stored[f"model.layers.{int(index) + 1}.{rest}.weight"]), name
        assert not weight.requires_grad
    half = SpanModel.from_dir(tiny_model_dir, 1, 3, dtype=torch.bfloat16)
    assert all(m.weight.is_contiguous() for m in half.layers.modules() if type(m) is torch.nn.Linear)


def test_which_steps_may_share_a_forward() -> None:
    """One new token per row after the session's history may join a batch, with a padded batch's mask and its rows'
    positions; a mask that hides a row's new token or does not cover history + 1, a rollback or beam reorder, and a
    step of several tokens run alone."""
    from swarmlm.protocol.bundle import SpanTensors
    from swarmlm.server.backend import _plain_decode

    cache = DynamicCache()
    cache.update(torch.zeros(2, 1, 5, 4), torch.zeros(2, 1, 5, 4), 0)  # 5 tokens of history, 2 rows
    token = torch.zeros(2, 1, 8)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    positions = torch.tensor([[3], [5]])
    assert _plain_decode(cache, 0, SpanTensors(token), None)
    assert _plain_decode(cache, 0, SpanTensors(token), 5)
    assert _plain_decode(cache, 0, SpanTensors(token, attention_mask=mask, position_ids=positions), None)
    hidden_new = mask.clone()
    hidden_new[0, -1] = 0
    assert not _plain_decode(cache, 0, SpanTensors(token, attention_mask=hidden_new), None)
    assert not _plain_decode(cache, 0, SpanTensors(token, attention_mask=mask[:, 1:]), None)
    assert not _plain_decode(cache, 0, SpanTensors(token), 4)  # a rollback
    assert not _plain_decode(cache, 0, SpanTensors(token, hypo_ids=torch.tensor([1, 0])), None)
    assert not _plain_decode(cache, 0, SpanTensors(torch.zeros(2, 2, 8)), None)
    assert not _plain_decode(cache, 0, SpanTensors(token, position_ids=torch.tensor([[3, 4], [5, 6]])), None)
