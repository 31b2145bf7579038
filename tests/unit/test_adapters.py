"""LoRA adapters loaded into a span: the span with an adapter equals the local PEFT model, without one the base
model, whichever ran before; adapters that would need more than the blocks are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.cache_utils import DynamicCache

from swarmlm.errors import ModelLoadError, ProtocolError
from swarmlm.models.adapters import adapter_name, load_adapters
from swarmlm.models.batched import decode_batched
from swarmlm.models.span import SpanModel
from swarmlm.server.validation import SpanLimits, check_adapter
from tests.conftest import load_reference
from tests.tiny_families import build_adapter, build_tiny, load_peft_reference

ATOL = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("adapters")
    model_dir = build_tiny("qwen2", root / "model")
    everywhere = build_adapter(model_dir, root / "everywhere", seed=1)
    # only blocks 1 and 2, and other modules: a block without this adapter must stay the base block
    some = build_adapter(model_dir, root / "some-blocks", seed=2, layers_to_transform=[1, 2],
                         target_modules=["k_proj", "o_proj", "up_proj"])  # fmt: skip
    return model_dir, everywhere, some


def spans(model_dir: Path, adapters: list[Path]) -> list[SpanModel]:
    made = []
    for start, end in [(0, 2), (2, 4)]:
        span = SpanModel.from_dir(model_dir, start, end)
        load_adapters(span, adapters)
        made.append(span)
    return made


def through(made: list[SpanModel], hidden: torch.Tensor, adapter: str | None) -> torch.Tensor:
    for span in made:
        hidden = span(hidden, adapter=adapter)
    return hidden


def test_a_fresh_span_with_adapters_computes_the_base_model_first(setup) -> None:
    # PEFT injects adapters enabled; before any request named one, a request naming none once ran with the last
    model_dir, everywhere, some = setup
    made = spans(model_dir, [everywhere, some])
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(7))
    reference = load_reference(model_dir)
    with torch.inference_mode():
        embeds, base = reference.model.embed_tokens(ids), reference.model(ids).last_hidden_state
        hidden = reference.model.norm(through(made, embeds, None))
    assert (hidden - base).abs().max().item() <= ATOL


def test_spans_with_an_adapter_equal_the_local_peft_model(setup) -> None:
    model_dir, everywhere, some = setup
    made = spans(model_dir, [everywhere, some])
    assert made[0].adapters == ("everywhere", "some-blocks")
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    reference = load_reference(model_dir)
    with torch.inference_mode():
        embeds, base = reference.model.embed_tokens(ids), reference.model(ids).last_hidden_state
        expected = {
            name: load_peft_reference(model_dir, folder).base_model.model.model(ids).last_hidden_state
            for name, folder in [("everywhere", everywhere), ("some-blocks", some)]
        }
        expected[None] = base
        # each adapter after each other one, and none in between: switching leaves nothing behind
        for adapter in ["everywhere", "some-blocks", None, "everywhere", None, "some-blocks"]:
            hidden = reference.model.norm(through(made, embeds, adapter))
            assert (hidden - expected[adapter]).abs().max().item() <= ATOL, adapter
            assert adapter is None or (expected[adapter] - base).abs().max().item() > 1e-2  # the adapter matters
    assert not any(p.requires_grad for p in made[0].parameters())


def test_batched_decode_applies_the_adapter(setup) -> None:
    model_dir, everywhere, _ = setup
    (span,) = spans(model_dir, [everywhere])[:1]
    torch.manual_seed(3)
    caches = [[DynamicCache() for _ in range(2)] for _ in range(2)]  # [alone, batched] per session
    with torch.inference_mode():
        for length, pair in zip([3, 5], caches, strict=True):
            prefix = torch.randn(1, length, 64)
            for cache in pair:
                span(prefix, cache=cache, adapter="everywhere")
        tokens = [torch.randn(1, 1, 64) for _ in caches]
        expected = [span(t, cache=pair[0], adapter="everywhere") for t, pair in zip(tokens, caches, strict=True)]
        span.use_adapter(None)  # whatever ran before, the batch applies its own adapter
        got = decode_batched(span, tokens, [pair[1] for pair in caches], 0, 2, adapter="everywhere")
    assert all((g - e).abs().max().item() <= ATOL for g, e in zip(got, expected, strict=True))


def test_adapters_needing_more_than_the_blocks_are_refused(setup, tmp_path: Path) -> None:
    model_dir, everywhere, _ = setup
    span = SpanModel.from_dir(model_dir, 0, 2)
    head = tmp_path / "head"
    head.mkdir()
    (head / "adapter_config.json").write_text((everywhere / "adapter_config.json").read_text())
    tensors = load_file(everywhere / "adapter_model.safetensors")
    with_head = {**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}
    save_file(with_head, head / "adapter_model.safetensors")
    with pytest.raises(ModelLoadError, match="adapts no decoder block"):
        load_adapters(span, [head])
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "adapter_config.json").write_text((everywhere / "adapter_config.json").read_text())
    save_file({k: v for k, v in tensors.items() if "v_proj" not in k}, partial / "adapter_model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks LoRA tensors"):
        load_adapters(SpanModel.from_dir(model_dir, 0, 2), [partial])
    other = tmp_path / "ia3"
    other.mkdir()
    (other / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(ModelLoadError, match="not a LoRA adapter"):
        load_adapters(span, [other])
    with pytest.raises(ModelLoadError, match="not a valid adapter name"):
        adapter_name(tmp_path / "bad name")
    with pytest.raises(ModelLoadError, match="same name"):
        load_adapters(span, [everywhere, everywhere])


def test_requests_may_name_only_adapters_served_here() -> None:
    limits = SpanLimits(start=0, end=2, hidden_size=64, max_tokens=64, max_position=256, adapters=("a",))
    check_adapter(None, limits)
    check_adapter("a", limits)
    with pytest.raises(ProtocolError, match="adapter 'b' is not served here \\(adapters served: a\\)") as refused:
        check_adapter("b", limits)
    # another server may hold it: the client re-routes (and says at once which adapters are held where, if none does)
    assert getattr(refused.value, "error_kind", None) == "not_served"
