"""Weight-only int8 blocks: logits within a stated tolerance of fp32, input gradients too, ~4x less weight memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmlm.models.quant import Int8Linear, module_bytes, quantize_int8
from swarmlm.models.span import SpanModel
from tests.conftest import load_reference
from tests.tiny_families import build_tiny

# the stated tolerance: max |logits - fp32 logits| <= this fraction of max |fp32 logits| (README)
INT8_LOGITS_RTOL = 0.05


@pytest.fixture(scope="module", params=["llama", "qwen2", "mixtral"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def test_int8_logits_and_gradients_are_within_tolerance(model_dir: Path) -> None:
    reference = load_reference(model_dir).requires_grad_(False)
    exact, quantized = SpanModel.from_dir(model_dir, 0, 4), SpanModel.from_dir(model_dir, 0, 4)
    assert quantize_int8(quantized.layers) > 0
    assert not any(type(m) is torch.nn.Linear for m in quantized.layers.modules())
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for span in (exact, quantized):
        embeds = reference.model.embed_tokens(ids).detach().requires_grad_()
        logits = reference.lm_head(reference.model.norm(span(embeds)))
        logits.square().sum().backward()
        results.append((logits.detach(), embeds.grad))
    (logits, grad), (q_logits, q_grad) = results
    assert (q_logits - logits).abs().max() <= INT8_LOGITS_RTOL * logits.abs().max()
    assert (q_grad - grad).abs().max() <= INT8_LOGITS_RTOL * grad.abs().max() * 4  # gradients amplify the error
    assert not torch.equal(q_logits, logits)  # the weights really are quantized


def test_int8_rows_round_trip_and_memory_shrinks(model_dir: Path) -> None:
    span = SpanModel.from_dir(model_dir, 0, 1)
    linear = span.layers[0].self_attn.q_proj
    quantized = Int8Linear(linear)
    error = (quantized.weight_int8.float() * quantized.scale - linear.weight).abs()
    assert (error <= quantized.scale / 2 + 1e-7).all()  # each weight within half a step of its row's scale
    before = module_bytes(span.layers)
    quantize_int8(span.layers)
    # dense blocks: ~4x; Mixtral's stacked experts are no Linear and stay float
    assert before / module_bytes(span.layers) > (1.1 if span.config.model_type == "mixtral" else 3.0)
