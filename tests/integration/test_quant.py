"""A server started with --quant int8: announced as dtype int8, used only by clients that accept it, and its
logits and gradients stay within the stated tolerance of fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmlm.errors import MissingBlocksError
from tests.conftest import connected_model, load_reference, running_swarm
from tests.unit.test_quant import INT8_LOGITS_RTOL


def test_an_int8_server_is_opt_in_and_close_to_fp32(tiny_model_dir: Path) -> None:
    reference = load_reference(tiny_model_dir).requires_grad_(False)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = reference(ids).logits
    with running_swarm(tiny_model_dir, [(0, 5)], extra_args=["--quant", "int8"]) as swarm:
        with connected_model(tiny_model_dir, swarm, missing_blocks_timeout_s=1.0) as model:
            with pytest.raises(MissingBlocksError):  # exact-only clients (the default) do not use it
                model(ids)
        with connected_model(tiny_model_dir, swarm, accepted_dtypes=("int8",)) as model:
            assert model.server_info(swarm.servers[0].peer_id).dtype == "int8"
            embeds = reference.model.embed_tokens(ids).detach().requires_grad_()
            logits = model(inputs_embeds=embeds).logits
            logits.square().sum().backward()
            output = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert (logits.detach() - expected).abs().max() <= INT8_LOGITS_RTOL * expected.abs().max()
    assert not torch.equal(logits.detach(), expected)
    local = reference.model.embed_tokens(ids).detach().requires_grad_()
    reference(inputs_embeds=local).logits.square().sum().backward()
    assert (embeds.grad - local.grad).abs().max() <= INT8_LOGITS_RTOL * 4 * local.grad.abs().max()
    assert output.shape == (1, 13)
