"""Weight-only int8 and nf4 blocks: logits within a stated tolerance of fp32, input gradients too, less weight
memory; nf4 blocks compute exactly what float blocks with the dequantized weights compute, forward and backward."""

from __future__ import annotations

import copy
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from swarmlm.errors import SwarmError
from swarmlm.models.quant import (
    NF4_BLOCKSIZE,
    Int8Linear,
    Nf4Linear,
    bnb_functional,
    module_bytes,
    quantize,
    quantize_int8,
)
from swarmlm.models.span import SpanModel
from tests.conftest import load_reference
from tests.tiny_families import build_tiny

# the stated tolerance: max |logits - fp32 logits| <= this fraction of max |fp32 logits| (README)
INT8_LOGITS_RTOL = 0.05
# 4 bits per weight cost more: 15-19% measured on the tiny models (README)
NF4_LOGITS_RTOL = 0.3
LOGITS_RTOL = {"int8": INT8_LOGITS_RTOL, "nf4": NF4_LOGITS_RTOL}
# the largest gap between neighbouring NF4 code values (-1 and -0.6962), as a fraction of the block's largest |weight|
NF4_LARGEST_GAP = 0.3038


@pytest.fixture(scope="module", params=["llama", "qwen2", "mixtral"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def logits_and_input_grad(span: SpanModel, reference: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    embeds = reference.model.embed_tokens(ids).detach().requires_grad_()
    logits = reference.lm_head(reference.model.norm(span(embeds)))
    logits.square().sum().backward()
    assert embeds.grad is not None
    return logits.detach(), embeds.grad


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_logits_and_gradients_are_within_tolerance(model_dir: Path, mode: str) -> None:
    reference = load_reference(model_dir).requires_grad_(False)
    exact, quantized = SpanModel.from_dir(model_dir, 0, 4), SpanModel.from_dir(model_dir, 0, 4)
    assert quantize(quantized.layers, mode) > 0
    assert not any(type(m) is torch.nn.Linear for m in quantized.layers.modules())
    logits, grad = logits_and_input_grad(exact, reference)
    q_logits, q_grad = logits_and_input_grad(quantized, reference)
    assert (q_logits - logits).abs().max() <= LOGITS_RTOL[mode] * logits.abs().max()
    assert (q_grad - grad).abs().max() <= LOGITS_RTOL[mode] * grad.abs().max() * 4  # gradients amplify the error
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


def test_nf4_blocks_round_trip_and_memory_shrinks(model_dir: Path) -> None:
    span = SpanModel.from_dir(model_dir, 0, 1)
    linear = span.layers[0].self_attn.q_proj
    quantized = Nf4Linear(linear)
    assert quantized.weight_nf4.dtype == torch.uint8 and quantized.weight_nf4.numel() * 2 == linear.weight.numel()
    error = (quantized.dequantized(torch.float32) - linear.weight).reshape(-1, NF4_BLOCKSIZE)  # row-major blocks
    # each weight within half of the largest code gap of its block's scale
    assert (error.abs() <= quantized.absmax[:, None] * NF4_LARGEST_GAP / 2 + 1e-7).all()
    assert error.abs().max() > 0
    before = module_bytes(span.layers)
    quantize(span.layers, "nf4")
    # dense blocks: ~7x (4 bits and a float32 scale per 64 weights); Mixtral's stacked experts stay float
    assert before / module_bytes(span.layers) > (1.1 if span.config.model_type == "mixtral" else 6.0)


def test_nf4_blocks_compute_what_their_dequantized_float_weights_compute(model_dir: Path) -> None:
    reference = load_reference(model_dir).requires_grad_(False)
    quantized = SpanModel.from_dir(model_dir, 0, 4)
    quantize(quantized.layers, "nf4")
    dense = SpanModel.from_dir(model_dir, 0, 4)
    for name, module in quantized.layers.named_modules():
        if isinstance(module, Nf4Linear):
            dense.layers.get_submodule(name).weight.data.copy_(module.dequantized(torch.float32))
    logits, grad = logits_and_input_grad(dense, reference)
    # a copy runs too: the quantized weights are plain buffers, not state bitsandbytes keeps elsewhere
    for span in (quantized, copy.deepcopy(quantized)):
        q_logits, q_grad = logits_and_input_grad(span, reference)
        torch.testing.assert_close(q_logits, logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(q_grad, grad, rtol=0, atol=1e-5)


def test_nf4_without_bitsandbytes_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)  # makes the import fail
    bnb_functional.cache_clear()
    try:
        linear = torch.nn.Sequential(torch.nn.Linear(64, 64))
        with pytest.raises(SwarmError, match=r"pip install 'swarmlm\[nf4\]'"):
            quantize(linear, "nf4")
        assert type(linear[0]) is torch.nn.Linear  # refused before anything was replaced
    finally:
        bnb_functional.cache_clear()


def test_nf4_in_a_worker_thread_keeps_to_torchs_thread_count() -> None:
    """bitsandbytes' OpenMP loops would otherwise start a thread per core in a thread where torch set no count."""
    quantized = Nf4Linear(torch.nn.Linear(256, 256))
    counts: list[int] = []

    def dequantize() -> None:
        before = len(os.listdir("/proc/self/task"))
        quantized.dequantized(torch.float32)
        counts.extend([before, len(os.listdir("/proc/self/task"))])

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        worker = threading.Thread(target=dequantize)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert counts[0] == counts[1]  # one OpenMP thread: the caller itself, no pool
