"""Deep prompt tuning and LoRA of the bundled SmolLM2 through a real swarm: a few optimizer steps lower the task's
loss, and what was trained saves and loads back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmlm.models.loading import load_tokenizer
from swarmlm.tools.local_swarm import LocalSwarm
from swarmlm.tools.train import DEFAULT_LR, SentimentTask, load_examples, split_examples
from tests.conftest import connected_model, running_swarm


@pytest.fixture(scope="module")
def swarm(smollm_dir: Path) -> Iterator[LocalSwarm]:
    with running_swarm(smollm_dir, [(0, 15), (15, 30)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def task(smollm_dir: Path) -> SentimentTask:
    return SentimentTask(load_tokenizer(smollm_dir))


def train_steps(model: torch.nn.Module, task: SentimentTask, batch: list, lr: float, steps: int = 4) -> list[float]:
    """The losses of `steps` Adam steps on one batch, then the loss after them."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)  # frozen parameters are simply skipped
    losses = []
    for _ in range(steps):
        loss = task.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        losses.append(task.loss(model, batch).item())
    return losses


def test_a_few_steps_lower_the_loss_and_prompts_round_trip(smollm_dir: Path, swarm, task, tmp_path: Path) -> None:
    train_set, _ = split_examples(load_examples(), held_out=80)
    batch = train_set[:6]
    torch.manual_seed(0)  # the prompts' initial values
    with connected_model(smollm_dir, swarm, tuning_mode="deep_ptune", pre_seq_len=4) as model:
        losses = train_steps(model, task, batch, lr=3e-3)
        model.save_prompts(tmp_path)
        expected = model.prompt_tuning.deep_prompts.detach().clone()
    assert losses[-1] < losses[0] * 0.9, losses
    with connected_model(smollm_dir, swarm, tuning_mode="deep_ptune", pre_seq_len=4) as fresh:
        fresh.load_prompts(tmp_path)
        assert torch.equal(fresh.prompt_tuning.deep_prompts, expected)
        with torch.no_grad():
            assert abs(task.loss(fresh, batch).item() - losses[-1]) < 1e-4


def test_a_few_lora_steps_lower_the_loss_and_the_adapter_round_trips(
    smollm_dir: Path, swarm, task, tmp_path: Path
) -> None:
    train_set, _ = split_examples(load_examples(), held_out=80)
    batch = train_set[6:12]
    torch.manual_seed(0)  # the LoRA weights' initial values
    with connected_model(smollm_dir, swarm, tuning_mode="lora") as model:
        assert model.lora_tuning.spec.rank == 8 and model.lora_tuning.spec.targets == ("q_proj", "v_proj")
        losses = train_steps(model, task, batch, lr=DEFAULT_LR["lora"])
        model.save_adapter(tmp_path)
    assert losses[-1] < losses[0] * 0.9, losses
    with connected_model(smollm_dir, swarm, tuning_mode="lora") as fresh:
        fresh.load_adapter(tmp_path)
        with torch.no_grad():
            assert abs(task.loss(fresh, batch).item() - losses[-1]) < 1e-4
    with (
        connected_model(smollm_dir, swarm, tuning_mode="lora", lora_rank=4) as other,
        pytest.raises(ValueError, match="r=8"),
    ):
        other.load_adapter(tmp_path)
