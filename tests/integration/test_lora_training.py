"""LoRA trained through real servers (tuning_mode="lora"): loss and every LoRA gradient equal local PEFT autograd,
also after a server dies between forward and backward; greedy generation with the in-training weights equals local
PEFT; save_adapter writes a folder that PEFT loads and `swarmlm serve --adapters` serves with the same outputs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.tools.local_swarm import LocalSwarm
from tests.conftest import LOGITS_ATOL, connected_model, load_reference, running_swarm
from tests.integration.test_backward_tiny import CHECKS_OFF, assert_close

RANK, ALPHA = 4, 8
TARGETS = ("q_proj", "v_proj", "down_proj")
OPTIONS = dict(tuning_mode="lora", lora_rank=RANK, lora_alpha=ALPHA, lora_target_modules=TARGETS)


@pytest.fixture(scope="module")
def swarm(tiny_model_dir: Path) -> Iterator[LocalSwarm]:
    """Blocks 0:2 and two replicas of 2:5: every route has two servers, and one of them can be lost."""
    with running_swarm(tiny_model_dir, [(0, 2), (2, 5), (2, 5)]) as swarm:
        yield swarm


def peft_reference(model_dir: Path) -> torch.nn.Module:
    """The local PEFT model with the same LoraConfig (its weights are set from the client's by copy_lora)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0)
    return get_peft_model(load_reference(model_dir), config).eval()


def copy_lora(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    tuning = model.lora_tuning
    parameters = dict(reference.named_parameters())
    with torch.no_grad():
        for name, a, b in zip(tuning.names(), tuning.lora_A, tuning.lora_B, strict=True):
            parameters[f"{name}.lora_A.default.weight"].copy_(a)
            parameters[f"{name}.lora_B.default.weight"].copy_(b)


def peft_grads(model: torch.nn.Module, reference: torch.nn.Module) -> list[torch.Tensor]:
    """The reference's LoRA gradients in the client's parameter order (A, B of each module)."""
    parameters = dict(reference.named_parameters())
    return [parameters[f"{name}.lora_{m}.default.weight"].grad for name in model.lora_tuning.names() for m in "AB"]


def client_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    tuning = model.lora_tuning
    return [t.grad for a, b in zip(tuning.lora_A, tuning.lora_B, strict=True) for t in (a, b)]


@pytest.fixture
def lora_model(tiny_model_dir: Path, swarm: LocalSwarm) -> Iterator[torch.nn.Module]:
    """A lora-mode client whose B matrices are non-zero (PEFT starts them at zero: A's gradients would be zero)."""
    with connected_model(tiny_model_dir, swarm, **OPTIONS, **CHECKS_OFF) as model:
        torch.manual_seed(0)
        with torch.no_grad():
            for b in model.lora_tuning.lora_B:
                b.normal_(std=0.2)
        yield model


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (3, 9), generator=generator)
    labels = ids.clone()
    labels[0, :4] = -100  # the loss covers some positions only
    return ids, labels


def loss_and_grads(model: torch.nn.Module, reference: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor):
    """Loss, input-embedding gradient and LoRA gradients: through the swarm, then local PEFT on the same weights."""
    copy_lora(model, reference)
    results = []
    for local, net in ((False, model), (True, reference)):
        net.zero_grad()
        embed = reference.get_input_embeddings()
        embeds = embed(ids).detach().requires_grad_()
        loss = net(inputs_embeds=embeds, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), embeds.grad, *(peft_grads(model, reference) if local else client_grads(model))))
    return results


def test_loss_and_lora_gradients_equal_local_peft(tiny_model_dir: Path, lora_model) -> None:
    trainable = [n for n, p in lora_model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 5 * len(TARGETS) and all(n.startswith("lora_tuning.") for n in trainable)
    reference = peft_reference(tiny_model_dir)
    remote, local = loss_and_grads(lora_model, reference, *batch(1))
    assert abs(remote[0].item() - local[0].item()) <= 1e-5 * abs(local[0].item())
    assert len(remote) == 2 + 2 * 5 * len(TARGETS)
    for actual, expected in zip(remote[1:], local[1:], strict=True):
        assert_close(actual, expected)
    peers = {call.peer_id for call in lora_model.last_trace.calls}
    assert len(peers) == 2  # the backward went through two servers


def test_sub_batches_sum_their_lora_gradients(tiny_model_dir: Path, swarm: LocalSwarm) -> None:
    with connected_model(tiny_model_dir, swarm, **OPTIONS, **CHECKS_OFF, max_tokens_per_request=9) as model:
        torch.manual_seed(1)
        with torch.no_grad():
            for b in model.lora_tuning.lora_B:
                b.normal_(std=0.2)
        remote, local = loss_and_grads(model, peft_reference(tiny_model_dir), *batch(8))  # 3 rows of 9: 3 pieces
        assert len(model.last_trace.calls) == 3 * 2  # the backward: 3 sub-batches through 2 servers each
    assert abs(remote[0].item() - local[0].item()) <= 1e-5 * abs(local[0].item())
    for actual, expected in zip(remote[1:], local[1:], strict=True):
        assert_close(actual, expected)


def test_an_optimizer_step_moves_the_weights_like_peft(tiny_model_dir: Path, lora_model) -> None:
    reference = peft_reference(tiny_model_dir)
    copy_lora(lora_model, reference)
    ids, labels = batch(2)
    for net in (lora_model, reference):
        optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.5)
        net(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    parameters = dict(reference.named_parameters())
    tuning = lora_model.lora_tuning
    for name, a, b in zip(tuning.names(), tuning.lora_A, tuning.lora_B, strict=True):
        for param, peft_param in ((a, parameters[f"{name}.lora_A.default.weight"]),
                                  (b, parameters[f"{name}.lora_B.default.weight"])):  # fmt: skip
            assert_close(param.detach(), peft_param.detach())


def test_greedy_generation_with_in_training_weights_equals_local_peft(tiny_model_dir: Path, lora_model) -> None:
    reference = peft_reference(tiny_model_dir)
    copy_lora(lora_model, reference)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected = reference.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        base = load_reference(tiny_model_dir).generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    assert expected.tolist() != base.tolist()  # the LoRA weights change the output
    output = lora_model.generate(ids, max_new_tokens=6, do_sample=False)
    assert output.tolist() == expected.tolist()


def test_saved_adapter_loads_in_peft_back_into_a_client_and_is_served(
    tiny_model_dir: Path, swarm: LocalSwarm, lora_model, tmp_path: Path
) -> None:
    from peft import PeftModel

    folder = tmp_path / "trained"
    lora_model.save_adapter(folder)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        in_training = lora_model(ids).logits
        loaded = PeftModel.from_pretrained(load_reference(tiny_model_dir), folder).eval()
        assert (loaded(ids).logits - in_training).abs().max().item() <= LOGITS_ATOL
    with connected_model(tiny_model_dir, swarm, **OPTIONS) as fresh:
        fresh.load_adapter(folder)
        with torch.inference_mode():
            assert (fresh(ids).logits - in_training).abs().max().item() <= LOGITS_ATOL
    server = swarm.add_server(0, 5, extra_args=["--adapters", str(folder)])
    try:
        with connected_model(tiny_model_dir, swarm, active_adapter="trained") as served:
            with torch.inference_mode():
                logits = served(ids).logits
            assert {call.peer_id for call in served.last_trace.calls} == {server.peer_id}
    finally:
        swarm.stop_server(server)
    assert (logits - in_training).abs().max().item() <= LOGITS_ATOL


def test_sigkill_between_forward_and_backward_keeps_lora_gradients_exact(
    tiny_model_dir: Path, swarm: LocalSwarm, lora_model
) -> None:
    reference = peft_reference(tiny_model_dir)
    copy_lora(lora_model, reference)
    ids, labels = batch(6)
    loss = lora_model(input_ids=ids, labels=labels).loss  # this module's last test: it kills a server
    manager = lora_model.model.layers.client.manager
    used = [s for s in swarm.servers[1:3] if manager.health.has_measured(s.peer_id)]
    assert len(used) == 1
    swarm.kill(used[0])
    loss.backward()
    assert manager.health.failed(used[0].peer_id)  # the backward met the dead server and recomputed around it
    remote = client_grads(lora_model)
    reference(input_ids=ids, labels=labels).loss.backward()
    for actual, expected in zip(remote, peft_grads(lora_model, reference), strict=True):
        assert_close(actual, expected)


def test_generation_survives_a_lost_server_and_replays_with_the_lora_weights(
    tiny_model_dir: Path, swarm: LocalSwarm, lora_model
) -> None:
    reference = peft_reference(tiny_model_dir)
    copy_lora(lora_model, reference)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        expected = reference.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    spare = swarm.add_server(2, 5)  # the earlier test killed one of the two 2:5 servers
    with lora_model.inference_session(max_length=16) as session:
        first = lora_model.generate(ids, max_new_tokens=4, do_sample=False, session=session)
        (lost,) = [s for s in swarm.servers if s.peer_id == session.route[-1].peer_id]
        swarm.kill(lost)
        output = lora_model.generate(first, max_new_tokens=4, do_sample=False, session=session)
        assert session.route[-1].peer_id == spare.peer_id  # its cache was rebuilt there, with the LoRA weights
    assert output.tolist() == expected.tolist()
