"""Servers started with --quant int8 or nf4: announced as that dtype, used only by clients that accept it; their
logits and gradients through the swarm are those of the same quantization run locally, within the stated tolerance
of fp32, and generation runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from swarmlm.errors import MissingBlocksError
from swarmlm.models.quant import module_bytes, quantize
from swarmlm.models.span import SpanModel
from tests.conftest import connected_model, load_reference, running_swarm
from tests.unit.test_quant import LOGITS_RTOL

BLOCKS = 5  # all blocks of the tiny Llama, on one server


def local_logits_and_grad(
    forward: Callable[[torch.Tensor], torch.Tensor], reference: torch.nn.Module, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of `forward` on the embeddings of `ids`, and the gradient of their squares' sum wrt the embeddings."""
    embeds = reference.model.embed_tokens(ids).detach().requires_grad_()
    logits = forward(embeds)
    logits.square().sum().backward()
    assert embeds.grad is not None
    return logits.detach(), embeds.grad


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_a_quantized_server_is_opt_in_and_computes_its_quantization(tiny_model_dir: Path, mode: str) -> None:
    reference = load_reference(tiny_model_dir).requires_grad_(False)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    span = SpanModel.from_dir(tiny_model_dir, 0, BLOCKS)
    fp32_bytes = module_bytes(span.layers)
    quantize(span.layers, mode)  # deterministic: the server quantizes the same weights the same way
    assert module_bytes(span.layers) < fp32_bytes / (6 if mode == "nf4" else 3)
    expected, expected_grad = local_logits_and_grad(lambda e: reference(inputs_embeds=e).logits, reference, ids)
    local, local_grad = local_logits_and_grad(
        lambda embeds: reference.lm_head(reference.model.norm(span(embeds))), reference, ids
    )
    with running_swarm(tiny_model_dir, [(0, BLOCKS)], extra_args=["--quant", mode]) as swarm:
        with connected_model(tiny_model_dir, swarm, missing_blocks_timeout_s=1.0) as model:
            with pytest.raises(MissingBlocksError):  # exact-only clients (the default) do not use it
                model(ids)
        with connected_model(tiny_model_dir, swarm, accepted_dtypes=(mode,)) as model:
            assert model.server_info(swarm.servers[0].peer_id).dtype == mode
            logits, grad = local_logits_and_grad(lambda embeds: model(inputs_embeds=embeds).logits, reference, ids)
            output = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(logits, local, rtol=0, atol=1e-4)
    torch.testing.assert_close(grad, local_grad, rtol=0, atol=1e-4)
    assert (logits - expected).abs().max() <= LOGITS_RTOL[mode] * expected.abs().max()
    assert (grad - expected_grad).abs().max() <= LOGITS_RTOL[mode] * 4 * expected_grad.abs().max()
    assert not torch.equal(logits, expected)
    assert output.shape == (1, 13)
