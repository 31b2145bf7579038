"""Activations sent as bfloat16, float16 or int8 with per-row scales (ClientConfig.wire_dtype) through a real swarm:
outputs and gradients stay within stated tolerances of a local float32 run; the default float32 wire is exact."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm

# largest |logit difference| to a local fp32 run of this tiny model (its logits are of order 1) when hidden states
# are rounded to the wire dtype at each of the 2 hops and each direction: a few units in the last place of 8 bits;
# int8 (measured: at most 0.0087 over 5 batches of 2x17 tokens, logits up to 0.64) is allowed 3.5 times that
WIRE_LOGITS_ATOL = {"bfloat16": 0.05, "float16": 0.01, "int8": 0.03}
# largest gradient difference, relative to the largest exact gradient (measured: bfloat16 0.0066, int8 0.016)
WIRE_GRAD_RTOL = {"bfloat16": 0.02, "int8": 0.05}


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(tiny_model_dir, [(0, 2), (2, 5)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir)


IDS = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("wire", ["bfloat16", "float16", "int8"])
def test_narrow_wire_logits_and_generation_stay_close(tiny_model_dir, swarm, reference, wire: str) -> None:
    with torch.inference_mode():
        expected = reference(IDS).logits
    with connected_model(tiny_model_dir, swarm, wire_dtype=wire) as model:
        logits = model(IDS).logits
        assert logits.dtype == torch.float32
        error = (logits - expected).abs().max().item()
        assert error <= WIRE_LOGITS_ATOL[wire]
        assert error > 0  # the rounding really happened: these tensors crossed as 16-bit values
        before = sum(info.pushes_received for info in model.server_infos().values())
        out = model.generate(IDS[:1, :5], max_new_tokens=4, do_sample=False)  # inference sessions round too
        assert out.shape == (1, 9)
        # the steps went on from server to server in the wire's form (a refused push would fall back to the client)
        assert sum(info.pushes_received for info in model.server_infos().values()) - before >= 4


@pytest.mark.parametrize("wire", ["bfloat16", "int8"])
def test_narrow_wire_gradients_stay_close(tiny_model_dir, swarm, reference, wire: str) -> None:
    hidden = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(6), requires_grad=True)
    with connected_model(tiny_model_dir, swarm, wire_dtype=wire) as model:
        remote = model.model.layers(hidden)
        (grad,) = torch.autograd.grad(remote.square().sum(), hidden)
    with connected_model(tiny_model_dir, swarm) as model:
        exact = model.model.layers(hidden)
        (exact_grad,) = torch.autograd.grad(exact.square().sum(), hidden)
    assert grad.dtype == torch.float32
    assert (grad - exact_grad).abs().max() <= WIRE_GRAD_RTOL[wire] * exact_grad.abs().max()


def test_the_default_wire_is_float32_and_exact(tiny_model_dir, swarm, reference) -> None:
    with torch.inference_mode():
        expected = reference(IDS).logits
    with connected_model(tiny_model_dir, swarm) as model:
        assert model.model.layers.client.manager.wire == torch.float32
        assert (model(IDS).logits - expected).abs().max().item() <= LOGITS_ATOL


def test_an_unknown_wire_dtype_is_refused(tiny_model_dir, swarm) -> None:
    with pytest.raises(ValueError, match="wire_dtype"), connected_model(tiny_model_dir, swarm, wire_dtype="int4"):
        pass
