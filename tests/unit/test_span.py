"""SpanModel: spans chained by hand reproduce the whole local model, masks and positions included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmlm.errors import ModelLoadError
from swarmlm.models.naming import default_dht_prefix
from swarmlm.models.registry import get_family
from swarmlm.models.span import SpanModel
from tests.conftest import load_reference


def chained(model_dir: Path, spans: list[tuple[int, int]], hidden: torch.Tensor, **kwargs: object) -> torch.Tensor:
    with torch.inference_mode():
        for start, end in spans:
            hidden = SpanModel.from_dir(model_dir, start, end)(hidden, **kwargs)
    return hidden


def test_chained_spans_equal_the_local_model(tiny_model_dir: Path) -> None:
    reference = load_reference(tiny_model_dir)
    ids = torch.randint(0, 128, (2, 11))
    with torch.inference_mode():
        expected = reference.model(ids).last_hidden_state
        embeds = reference.model.embed_tokens(ids)
    hidden = chained(tiny_model_dir, [(0, 2), (2, 3), (3, 5)], embeds)
    with torch.inference_mode():
        assert (reference.model.norm(hidden) - expected).abs().max().item() < 1e-5


def test_masks_and_positions_follow_the_local_model(tiny_model_dir: Path) -> None:
    reference = load_reference(tiny_model_dir)
    ids = torch.randint(0, 128, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        expected = reference.model(ids, attention_mask=mask, position_ids=positions).last_hidden_state
        embeds = reference.model.embed_tokens(ids)
    hidden = chained(tiny_model_dir, [(0, 3), (3, 5)], embeds, attention_mask=mask, position_ids=positions)
    with torch.inference_mode():
        assert (reference.model.norm(hidden)[mask.bool()] - expected[mask.bool()]).abs().max().item() < 1e-5


def test_a_span_reads_only_its_blocks(tiny_model_dir: Path) -> None:
    span = SpanModel.from_dir(tiny_model_dir, 1, 3)
    assert len(span.layers) == 2 and [layer.self_attn.layer_idx for layer in span.layers] == [1, 2]
    assert not any(p.is_meta for p in span.parameters())
    with pytest.raises(ValueError, match="outside"):
        SpanModel.from_dir(tiny_model_dir, 3, 9)


def test_unknown_families_are_named_in_the_error() -> None:
    class FakeConfig:
        model_type = "mamba"

    supported = "gemma2, gemma3_text, llama, mistral, mixtral, phi3, qwen2, qwen3"
    with pytest.raises(ModelLoadError, match=f"'mamba' is not supported yet; supported: {supported}"):
        get_family(FakeConfig())


def test_swarm_names_agree_across_ways_of_naming_a_model() -> None:
    assert default_dht_prefix("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert default_dht_prefix("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct"
    assert default_dht_prefix("/y/SmolLM2-135M-Instruct/") == "smollm2-135m-instruct"
