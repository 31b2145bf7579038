"""Every registered family's spans, run by hand, equal the local Hugging Face model: prefill with padding, cached
decode, batched decode of several sessions and their prompts run together, with sliding windows shorter than the
sequences."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.cache_utils import DynamicCache

from swarmlm.errors import ModelLoadError
from swarmlm.models.batched import decode_batched, prefill_batched
from swarmlm.models.loading import load_config
from swarmlm.models.mixtral import fused_experts
from swarmlm.models.registry import SLIDING_ATTENTION, get_family
from swarmlm.models.span import SpanModel
from tests.conftest import load_reference
from tests.tiny_families import FAMILIES, WINDOW, build_tiny, tiny_config

ATOL = 1e-5


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= ATOL


def test_chained_spans_equal_local_logits_with_padding(family_dir: Path) -> None:
    reference = load_reference(family_dir)
    family = get_family(reference.config)
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        expected = reference(ids, attention_mask=mask, position_ids=positions).logits
        hidden = reference.get_submodule(family.embed_name)(ids)
        for start, end in [(0, 1), (1, 3), (3, 4)]:
            span = SpanModel.from_dir(family_dir, start, end)
            hidden = span(hidden, attention_mask=mask, position_ids=positions)
        logits = family.final_logits(reference.config, reference.lm_head(reference.model.norm(hidden)))
    keep = mask.bool()
    assert close(logits[keep], expected[keep])


def test_cached_decode_past_the_window_equals_local(family_dir: Path) -> None:
    reference = load_reference(family_dir)
    family = get_family(reference.config)
    ids = torch.randint(3, 128, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(1))
    span = SpanModel.from_dir(family_dir, 0, reference.config.num_hidden_layers)
    cache = DynamicCache()
    with torch.inference_mode():
        expected = reference.model(ids).last_hidden_state
        embeds = reference.get_submodule(family.embed_name)(ids)
        outputs = [span(embeds[:, :WINDOW], cache=cache)]
        outputs += [span(embeds[:, t : t + 1], cache=cache) for t in range(WINDOW, ids.shape[1])]
        assert close(reference.model.norm(torch.cat(outputs, dim=1)), expected)


def test_batched_decode_equals_each_session_alone(family_dir: Path) -> None:
    torch.manual_seed(2)
    span = SpanModel.from_dir(family_dir, 1, 4)
    hidden_size = span.config.hidden_size
    lengths, rows = [2, 0, 2 * WINDOW + 1, WINDOW], [1, 2, 1, 1]  # shorter and longer than the window
    alone, batched = [], []
    with torch.inference_mode():
        for length, row in zip(lengths, rows, strict=True):
            prefix = torch.randn(row, length, hidden_size)
            caches = [DynamicCache(), DynamicCache()]
            for cache in caches:
                if length:
                    span(prefix, cache=cache)
            alone.append(caches[0])
            batched.append(caches[1])
        for _ in range(WINDOW + 1):  # steps that carry every session past the window
            tokens = [torch.randn(row, 1, hidden_size) for row in rows]
            expected = [span(t, cache=c) for t, c in zip(tokens, alone, strict=True)]
            got = decode_batched(span, tokens, batched, 1, 4)
            assert all(close(g, e) for g, e in zip(got, expected, strict=True))


def test_prompts_run_together_equal_each_alone(family_dir: Path) -> None:
    """Fresh sessions' prompts (none longer than the window) as one forward, then decode steps past the window."""
    torch.manual_seed(3)
    span = SpanModel.from_dir(family_dir, 1, 4)
    prompts = [torch.randn(1, length, span.config.hidden_size) for length in (WINDOW, 2, WINDOW - 1)]
    alone, together = [DynamicCache() for _ in prompts], [DynamicCache() for _ in prompts]
    with torch.inference_mode():
        expected = [span(p, cache=c) for p, c in zip(prompts, alone, strict=True)]
        got = prefill_batched(span, prompts, together, 1, 4)
        assert all(close(g, e) for g, e in zip(got, expected, strict=True))
        for _ in range(WINDOW + 1):
            tokens = [torch.randn(1, 1, span.config.hidden_size) for _ in prompts]
            expected = [span(t, cache=c) for t, c in zip(tokens, alone, strict=True)]
            got = decode_batched(span, tokens, together, 1, 4)
            assert all(close(g, e) for g, e in zip(got, expected, strict=True))


def test_batched_decode_of_left_padded_sessions_equals_each_alone(family_dir: Path) -> None:
    """A session generating for a left-padded batch of prompts sends its mask and its rows' positions with every
    step; such steps batch with other sessions' and give each what it gets alone."""
    torch.manual_seed(3)
    span = SpanModel.from_dir(family_dir, 1, 4)
    hidden_size = span.config.hidden_size
    # (prompt length, left padding of each row): padded rows beside plain ones, shorter and longer than the window
    sessions = [(WINDOW, [0]), (2 * WINDOW + 1, [3, 0]), (3, [0, 2]), (2, [1])]
    alone, batched, masks, positions = [], [], [], []
    with torch.inference_mode():
        for length, pads in sessions:
            mask = torch.ones(len(pads), length, dtype=torch.long)
            for row, pad in enumerate(pads):
                mask[row, :pad] = 0
            position = (mask.cumsum(-1) - 1).clamp(min=0)
            prefix = torch.randn(len(pads), length, hidden_size)
            caches = [DynamicCache(), DynamicCache()]
            for cache in caches:
                span(prefix, cache=cache, attention_mask=mask, position_ids=position)
            alone.append(caches[0])
            batched.append(caches[1])
            masks.append(mask)
            positions.append(position[:, -1:])
        for _ in range(WINDOW + 1):  # steps that carry every session past the window
            masks = [torch.cat([m, torch.ones(len(m), 1, dtype=m.dtype)], dim=1) for m in masks]
            positions = [p + 1 for p in positions]
            tokens = [torch.randn(len(m), 1, hidden_size) for m in masks]
            expected = [
                span(t, cache=c, attention_mask=m, position_ids=p)
                for t, c, m, p in zip(tokens, alone, masks, positions, strict=True)
            ]
            got = decode_batched(span, tokens, batched, 1, 4, None, masks, positions)
            assert all(close(g, e) for g, e in zip(got, expected, strict=True))


def test_windows_and_layer_kinds_come_from_the_family() -> None:
    kinds = {name: get_family(tiny_config(name)).layer_kinds(tiny_config(name)) for name in FAMILIES}
    assert kinds["mistral"] == [SLIDING_ATTENTION] * 4
    assert kinds["qwen2"] == ["full_attention", "full_attention", SLIDING_ATTENTION, SLIDING_ATTENTION]
    assert kinds["gemma3_text"] == kinds["gemma2"] == [SLIDING_ATTENTION, "full_attention"] * 2
    assert kinds["qwen3"] == kinds["phi3"] == kinds["mixtral"] == ["full_attention"] * 4
    for name in ("gemma2", "gemma3_text"):
        bidirectional = tiny_config(name)
        bidirectional.use_bidirectional_attention = True
        with pytest.raises(ModelLoadError, match="bidirectional"):
            get_family(bidirectional).layer_kinds(bidirectional)


def test_spans_run_the_attention_their_family_needs(family_dir: Path) -> None:
    """Gemma 2 soft-caps attention scores, which sdpa cannot (transformers raises when asked): its layers run eager
    attention, every other family's sdpa."""
    config = load_config(family_dir)
    assert config._attn_implementation == ("eager" if config.model_type == "gemma2" else "sdpa")
    assert SpanModel.from_dir(family_dir, 0, 1).config._attn_implementation == config._attn_implementation


def test_mixtral_experts_are_fused_like_transformers_does(tmp_path: Path) -> None:
    config = tiny_config("mixtral")
    stored = {f"block_sparse_moe.experts.{e}.{w}.weight": torch.randn(3, 3) for e in range(4) for w in ("w1", "w3")}
    with pytest.raises(ModelLoadError, match="w2 of experts \\[\\]"):
        fused_experts(config, stored)
    stored.update({f"block_sparse_moe.experts.{e}.w2.weight": torch.randn(3, 3) for e in range(4)})
    state = fused_experts(config, {**stored, "block_sparse_moe.gate.weight": torch.ones(4, 3)})
    assert torch.equal(state["mlp.experts.gate_up_proj"][2, 3:], stored["block_sparse_moe.experts.2.w3.weight"])
    assert torch.equal(state["mlp.experts.down_proj"][1], stored["block_sparse_moe.experts.1.w2.weight"])
    assert torch.equal(state["mlp.gate.weight"], torch.ones(4, 3))
    assert fused_experts(config, state) == state  # a checkpoint already in the fused layout passes as it is
