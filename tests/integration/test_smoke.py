"""The quick tier's real swarm (`./dev.sh test --quick`): one DHT and three servers of the tiny model on 127.0.0.1,
shared by a forward, a backward, a generation and a failover, each equal to a local run of the same weights.

The failover kills a server: it runs last, and the swarm is this module's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm

pytestmark = pytest.mark.smoke

# two halves and a whole replica: a route survives the loss of any one server
SPANS = [(0, 3), (3, 5), (0, 5)]
GRAD_RTOL = 1e-5


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(tiny_model_dir, SPANS, dht_prefix="tiny-smoke") as swarm:
        yield swarm


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir).requires_grad_(False)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path, swarm: LocalSwarm) -> Iterator[torch.nn.Module]:
    with connected_model(tiny_model_dir, swarm) as model:
        yield model


def ids(seed: int, batch: int = 2, seq: int = 9) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_forward_equals_local(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    with torch.inference_mode():
        expected = reference(ids(1)).logits
        assert (model(ids(1)).logits - expected).abs().max().item() <= LOGITS_ATOL


def test_backward_to_the_inputs_equals_local(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    weights = torch.randn(2, 9, 128, generator=torch.Generator().manual_seed(2))
    grads = []
    for run in (model, reference):
        embeds = reference.model.embed_tokens(ids(2)).detach().requires_grad_()
        (run(inputs_embeds=embeds).logits * weights).sum().backward()
        grads.append(embeds.grad)
    swarm, local = grads
    scale = local.abs().max().item()
    assert scale > 0 and (swarm - local).abs().max().item() <= GRAD_RTOL * scale + 1e-7


def test_generation_equals_local_greedy(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    prompt = ids(3, batch=1, seq=5)
    with torch.inference_mode():
        expected = reference.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False), expected)


def test_a_killed_server_is_routed_around(
    model: torch.nn.Module, reference: torch.nn.Module, swarm: LocalSwarm
) -> None:
    """Whichever server the last requests used, one of them is killed: the next forward and generation go on
    through the others, exactly."""
    used = set(model.last_trace.servers)
    victim = next(server for server in swarm.servers if server.peer_id in used)
    swarm.kill(victim)
    prompt = ids(4, batch=1, seq=5)
    with torch.inference_mode():
        expected_logits = reference(ids(4)).logits
        expected_tokens = reference.generate(prompt, max_new_tokens=8, do_sample=False)
        assert (model(ids(4)).logits - expected_logits).abs().max().item() <= LOGITS_ATOL
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False), expected_tokens)
    assert victim.peer_id not in model.last_trace.servers
