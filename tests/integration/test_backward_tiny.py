"""Autograd through remote blocks of a tiny Llama: gradients wrt inputs and (deep) prompts equal local autograd."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import connected_model, load_reference, running_swarm

# fp32 gradients through the swarm must match local autograd this closely (relative to their largest value)
GRAD_RTOL = 1e-5
PRE_SEQ_LEN = 3


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    assert scale > 0, "a zero gradient proves nothing"
    assert (actual - expected).abs().max().item() <= GRAD_RTOL * scale + 1e-7


def local_deep_ptune_logits(reference: torch.nn.Module, embeds: torch.Tensor, tuning: torch.nn.Module) -> torch.Tensor:
    """An independent local deep prompt tuning: hooks add each block's prompt to its input."""
    prefix = tuning.pre_seq_len
    handles = []
    for index, layer in enumerate(reference.model.layers):

        def add_prompt(module: torch.nn.Module, args: tuple, index: int = index) -> tuple:
            hidden = args[0].clone()
            hidden[:, :prefix] = hidden[:, :prefix] + tuning.deep_prompts[index]
            return (hidden, *args[1:])

        handles.append(layer.register_forward_pre_hook(add_prompt))
    try:
        prompt = tuning.prompt_embeddings.unsqueeze(0).expand(embeds.shape[0], -1, -1)
        return reference(inputs_embeds=torch.cat([prompt, embeds], dim=1)).logits[:, prefix:]
    finally:
        for handle in handles:
            handle.remove()


# spot checks off: the test needs to know which one replica a forward used
CHECKS_OFF = dict(verify_probability=0.0, verify_first_requests=0)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    return load_reference(tiny_model_dir).requires_grad_(False)


def gradients(model: torch.nn.Module, reference: torch.nn.Module, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
    """Gradients of a fixed linear function of the logits wrt input embeddings and all prompts: swarm, then local."""
    results = []
    for local in (False, True):
        tuning = model.prompt_tuning
        tuning.zero_grad()
        embeds = reference.model.embed_tokens(ids).detach().requires_grad_()
        logits = local_deep_ptune_logits(reference, embeds, tuning) if local else model(inputs_embeds=embeds).logits
        (logits * weights).sum().backward()
        results.append(
            (logits.detach(), embeds.grad, tuning.deep_prompts.grad.clone(), tuning.prompt_embeddings.grad.clone())
        )
    return results


@pytest.fixture
def tuned(tiny_model_dir: Path) -> Iterator:
    def make(swarm, **options: object):
        model_cm = connected_model(tiny_model_dir, swarm, tuning_mode="deep_ptune", pre_seq_len=PRE_SEQ_LEN, **options)
        model = model_cm.__enter__()
        torch.manual_seed(0)
        with torch.no_grad():  # non-zero deep prompts, so that they matter
            model.prompt_tuning.deep_prompts.normal_(std=0.5)
        opened.append(model_cm)
        return model

    opened = []
    yield make
    for model_cm in opened:
        model_cm.__exit__(None, None, None)


@pytest.mark.parametrize("spans", [[(0, 2), (2, 5)], [(0, 1), (1, 4), (4, 5)]], ids=["2-servers", "3-servers"])
def test_gradients_equal_local_autograd(tiny_model_dir: Path, reference, tuned, spans: list) -> None:
    ids = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(3, 9, 128, generator=torch.Generator().manual_seed(2))
    with running_swarm(tiny_model_dir, spans) as swarm:
        model = tuned(swarm)
        assert [n for n, p in model.named_parameters() if p.requires_grad] == [
            "prompt_tuning.prompt_embeddings",
            "prompt_tuning.deep_prompts",
        ]
        remote, local = gradients(model, reference, ids, weights)
        # every server ran the backward from the graph its forward kept (server/activations.py)
        for server in swarm.servers:
            assert "runs from its kept forward" in server.log_path.read_text(), server.log_tail()
    for actual, expected in zip(remote, local, strict=True):
        assert_close(actual, expected)


def test_per_sample_deep_prompts_equal_row_by_row_runs(tiny_model_dir: Path, reference) -> None:
    """Prompts of shape (blocks, batch, prefix, hidden): each row gets its own, across sub-batches too."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 6, 64, generator=generator)
    prompts = torch.randn(5, 3, 2, 64, generator=generator).requires_grad_()
    weights = torch.randn(3, 6, 64, generator=generator)
    with (
        running_swarm(tiny_model_dir, [(0, 2), (2, 5)]) as swarm,
        connected_model(tiny_model_dir, swarm, max_tokens_per_request=12) as model,
    ):
        layers = model.model.layers
        (layers(hidden, prompts=prompts) * weights).sum().backward()
        together = prompts.grad.clone()
        for row in range(3):
            shared = prompts.detach()[:, row].clone().requires_grad_()
            (layers(hidden[row : row + 1], prompts=shared) * weights[row : row + 1]).sum().backward()
            assert_close(together[:, row], shared.grad)


@pytest.fixture(scope="module")
def replicated_swarm(tiny_model_dir: Path) -> Iterator:
    with running_swarm(tiny_model_dir, [(0, 2), (2, 5), (2, 5)]) as swarm:
        yield swarm


def test_sub_batches_give_the_same_outputs_and_gradients(reference, tuned, replicated_swarm) -> None:
    ids = torch.randint(0, 128, (5, 6), generator=torch.Generator().manual_seed(3))
    weights = torch.randn(5, 6, 128, generator=torch.Generator().manual_seed(4))
    whole, _ = gradients(tuned(replicated_swarm), reference, ids, weights)
    split, local = gradients(tuned(replicated_swarm, max_tokens_per_request=18), reference, ids, weights)
    for a, b, c in zip(whole, split, local, strict=True):
        assert_close(a, c)
        assert_close(b, c)


def test_generation_with_deep_prompts_equals_local_greedy_decoding(reference, tuned, replicated_swarm) -> None:
    model = tuned(replicated_swarm)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(7))
    expected = ids
    with torch.no_grad():  # local greedy decoding by full recomputation, prompts added by hooks
        for _ in range(6):
            embeds = reference.model.embed_tokens(expected)
            next_ids = local_deep_ptune_logits(reference, embeds, model.prompt_tuning)[:, -1].argmax(-1)
            expected = torch.cat([expected, next_ids[:, None]], dim=1)
    output = model.generate(ids, max_new_tokens=6, do_sample=False)  # through server-side caches
    assert output.tolist() == expected.tolist()


def test_sigkill_between_forward_and_backward_keeps_gradients_exact(reference, tuned, replicated_swarm) -> None:
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    weights = torch.randn(2, 7, 128, generator=torch.Generator().manual_seed(6))
    model = tuned(replicated_swarm, **CHECKS_OFF)  # a spot check would call the other replica too
    embeds = reference.model.embed_tokens(ids).detach().requires_grad_()
    logits = model(inputs_embeds=embeds).logits
    manager = model.model.layers.client.manager
    used = [s for s in replicated_swarm.servers[1:] if manager.health.has_measured(s.peer_id)]
    assert len(used) == 1
    replicated_swarm.kill(used[0])
    (logits * weights).sum().backward()
    assert manager.health.failed(used[0].peer_id)  # the backward met the dead server and recomputed around it
    tuning = model.prompt_tuning
    remote = (embeds.grad, tuning.deep_prompts.grad.clone(), tuning.prompt_embeddings.grad.clone())
    _, local = gradients(model, reference, ids, weights)
    for actual, expected in zip(remote, local[1:], strict=True):
        assert_close(actual, expected)
